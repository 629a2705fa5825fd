"""Progress counters a run could never have written (hand-edited or hostile progress.msgpack)
are refused, naming the record, instead of resuming a run with impossible counts."""

import pytest

from progress import Counts, Progress, ProgressSchemaError, ProgressTree, decode_tree, encode_tree


def _tree(total, current):
    return ProgressTree(records={"epoch.batches": Progress(total=Counts(*total), current=Counts(*current))})


def test_counts_in_the_order_they_advance_round_trip():
    tree = _tree((9, 8, 8, 7), (3, 3, 2, 2))
    assert decode_tree(encode_tree(tree)) == tree


@pytest.mark.parametrize("total", [(5, 5, 5, 105), (5, 6, 5, 5), (5, 5, 4, 5)],
                         ids=["completed past started", "started past ready", "completed past processed"])
def test_counts_out_of_order_are_refused(total):
    with pytest.raises(ProgressSchemaError, match="record 'epoch.batches': Counts: .* is out of order"):
        decode_tree(encode_tree(_tree(total, (0, 0, 0, 0))))


def test_a_current_count_above_its_total_is_refused():
    with pytest.raises(ProgressSchemaError, match="record 'epoch.batches': .*current.completed 4 exceeds total.completed 3"):
        decode_tree(encode_tree(_tree((5, 5, 5, 3), (5, 5, 5, 4))))
