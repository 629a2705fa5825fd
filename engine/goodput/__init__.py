"""Goodput: the run's ledger of attempts (``ledger/rank-NNNNN.jsonl``), what it says about the
time spent (buckets that add up to the wall time, failures by cause, samples skipped or seen
twice), and a Monte-Carlo model of large jobs (docs/goodput.md).

Pure Python, no torch: ``python -m engine goodput`` imports none. The run's hooks are
:class:`engine.goodput.ledger.Ledger`; the reading side is :func:`engine.goodput.account.account`;
the model is :mod:`engine.goodput.simulate`.
"""

from engine.goodput.account import Account, account
from engine.goodput.ledger import Ledger
from engine.goodput.observed import ObservedCosts, observed_costs
from engine.goodput.simulate import JobModel, simulate, young_daly_interval

__all__ = ["Account", "JobModel", "Ledger", "ObservedCosts", "account", "observed_costs", "simulate",
           "young_daly_interval"]
