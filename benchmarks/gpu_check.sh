#!/usr/bin/env bash
# GPU check for splitloop (under 5 minutes on one GPU): the tests marked `gpu`, then a real
# SIGKILL / resume run on CUDA in "16-mixed" and "bf16-mixed", compared bit for bit with the
# uninterrupted run. Prints one verdict line: "gpu check: PASS ..." or "gpu check: FAIL ...".
#
#   benchmarks/gpu_check.sh            # uses ./.venv, creating it when missing
#   VENV=/path/to/venv benchmarks/gpu_check.sh
#
# Without a CUDA device it prints "gpu check: SKIP ..." and exits 0.
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${VENV:-$ROOT/.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
    # System packages stay visible: a machine with a CUDA torch installed uses it as it is.
    echo "creating $VENV" >&2
    python3 -m venv --system-site-packages "$VENV" \
        && { "$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/pip" install -q "torch==$TORCH_VERSION"; } \
        && "$VENV/bin/pip" install -q -e . pytest pytest-timeout numpy \
        || { echo "gpu check: FAIL could not create the virtual environment $VENV"; exit 1; }
fi
PY="$VENV/bin/python"

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" 2>/dev/null; then
    echo "gpu check: SKIP no CUDA device (torch.cuda.is_available() is False in $VENV); nothing was run"
    exit 0
fi
DEVICE=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0), '/ torch', torch.__version__, '/ CUDA', torch.version.cuda)")

# cuBLAS needs a fixed workspace to be deterministic; the same value in every process.
export CUBLAS_WORKSPACE_CONFIG=:4096:8
export PYTHONPATH="$ROOT:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}"
LOG=$(mktemp -d)/gpu_check
mkdir -p "$LOG"

timeout 150 "$PY" -m pytest -q -p no:xdist -p no:cacheprovider -m gpu tests > "$LOG/pytest.txt" 2>&1
TESTS_RC=$?
TESTS_SUMMARY=$(tail -n 1 "$LOG/pytest.txt")

# Kill / resume on CUDA: the scenarios run with TrainerConfig(device="auto"), i.e. CUDA here.
timeout 130 "$PY" - > "$LOG/kill.txt" 2>&1 <<'EOF'
import sys
import tempfile

import torch

torch.set_num_threads(1)
from kill_helpers import run_until_done
from scenarios import train_with_checkpoints
from engine.testing import compare_runs

failures = []
for name in ("fp16_accumulate", "bf16"):
    with tempfile.TemporaryDirectory() as work:
        reference, resumed = f"{work}/reference", f"{work}/resumed"
        train_with_checkpoints(name, reference)
        kills = run_until_done(name, resumed, "split_end_after_checkpoint:8:sigkill")
        differences = compare_runs(reference, resumed)
        print(f"{name}: {kills} kills, {'exact' if not differences else differences}")
        if kills < 1 or differences:
            failures.append(name)
sys.exit(1 if failures else 0)
EOF
KILL_RC=$?
KILL_SUMMARY=$(grep -E "^(fp16_accumulate|bf16):" "$LOG/kill.txt" | tr '\n' ' ')

if [ "$TESTS_RC" -eq 0 ] && [ "$KILL_RC" -eq 0 ]; then
    echo "gpu check: PASS on $DEVICE; gpu tests: $TESTS_SUMMARY; kill/resume: $KILL_SUMMARY"
    exit 0
fi
echo "gpu check: FAIL on $DEVICE; gpu tests (rc $TESTS_RC): $TESTS_SUMMARY; kill/resume (rc $KILL_RC): ${KILL_SUMMARY:-see log}; logs in $LOG"
exit 1
