#!/bin/sh
# PyTorch's own DataLoader tests against torch_stage.DataLoader (or, for the
# baseline, the plain class): the specification of the drop-in.
#
#   tests/pytorch_spec/run.sh plain|staged PATH/test_dataloader.py [pytest args]
#
# PATH/test_dataloader.py is PyTorch's test/test_dataloader.py (not part of
# this repository; take the version matching the installed torch). It runs
# from its own directory and imports torch.testing._internal, which needs
# `expecttest` and `psutil`. Run from the repository root, with the built
# extension; extra arguments go to pytest (-k to split the run).
set -eu
mode=$1
test_file=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
shift 2
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
case $mode in
  plain) unset TORCH_STAGE_DROPIN ;;
  staged) export TORCH_STAGE_DROPIN=1 ;;
  *) echo "mode must be plain or staged, got $mode" >&2; exit 2 ;;
esac
export PYTHONPATH="$root:$here${PYTHONPATH:+:$PYTHONPATH}"
cd "$(dirname "$test_file")"
exec "${PYTHON:-python}" -m pytest "$(basename "$test_file")" -p no:cacheprovider \
  --timeout 120 -rfEs "$@"
