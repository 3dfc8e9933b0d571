#!/usr/bin/env bash
# Submit `rlflow train [CONFIG.yaml] [key=value ...]` to a Ray cluster as a Ray job.
#
#   RAY_ADDRESS=http://<head>:8265 scripts/submit.sh configs/gsm8k_qwen2.5_0.5b.yaml trainer.total_steps=100
#   scripts/submit.sh --address http://127.0.0.1:8265 --no-wait -- trainer.total_steps=5
#   scripts/submit.sh --help
#
# The repository is uploaded as the job's working_dir (without .git, .venv*, outputs/); the job
# runs `python -m rlflow.cli train ...` there. Nothing is pip-installed unless --pip is given
# (then rlflow's dependencies from pyproject.toml go into a job virtualenv on the cluster).
# Waits and streams the logs unless --no-wait; exits 0 when the job SUCCEEDED.
# Needs the `ray` package where it runs (pip install 'ray[default]'); details: scripts/submit.py.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "${PYTHON:-python3}" "$here/submit.py" "$@"
