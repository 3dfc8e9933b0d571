"""examples/quickstart.ipynb runs headless (nbclient) with tiny settings, trains on rows and a reward
function defined in the notebook (the in-memory Python API), draws its progress bar as a notebook
widget and its plot as an image, and leaves no Ray process behind."""

from __future__ import annotations

import shlex
import time
from pathlib import Path

import ipykernel  # noqa: F401  (the notebook's kernel; a test dependency)
import nbclient
import nbformat
import pytest

from conftest import tiny_overrides
from test_job_submit import CpuSampler, _marked_pids

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "quickstart.ipynb"


def _outputs(nb, output_type=None):
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if output_type is None or out["output_type"] == output_type:
                yield cell, out


def test_notebook_is_small_and_clean():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert not list(_outputs(nb)), "the notebook is committed without outputs"
    kinds = [c.cell_type for c in nb.cells]
    assert kinds.count("markdown") >= 4 and kinds.count("code") <= 8
    sources = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "ray.shutdown()" in sources and "num_cpus=NUM_CPUS" in sources
    # the in-memory Python API: rows and a reward function defined in the notebook
    assert "RLFlow(cfg, train_dataset=train_rows, val_dataset=val_rows, reward_fn=my_reward).fit()" in sources
    assert "def my_reward(data_source, solution_str, ground_truth, extra_info=None):" in sources


@pytest.mark.timeout(600)
def test_quickstart_notebook_runs_headless(tiny_model_dir, tmp_path, monkeypatch):
    overrides = tiny_overrides(tiny_model_dir, **{
        "trainer.total_steps": 2, "trainer.logger": "[console,jsonl]",
        "trainer.default_local_dir": str(tmp_path / "outputs"),
        "algorithm.adv_estimator": "grpo",  # the notebook's own option: no critic process to start
    })
    marker = f"nb-{tmp_path.name}"
    # the kernel inherits this environment (monkeypatch puts it back afterwards)
    monkeypatch.setenv("RLFLOW_NOTEBOOK_OVERRIDES", shlex.join(overrides))
    monkeypatch.setenv("RLFLOW_TEST_JOB_CLUSTER", marker)  # finds the kernel's Ray processes
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # the notebook starts its own local Ray
    monkeypatch.setenv("MPLBACKEND", "agg")  # `%matplotlib inline` takes over inside the kernel

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=420, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    started = time.monotonic()
    with CpuSampler(marker) as sampler:
        try:
            client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
        finally:
            nbformat.write(nb, tmp_path / "executed.ipynb")  # for a look after a failure
        run_s = time.monotonic() - started
        # ray.shutdown() in the last cell stopped the kernel's Ray; the kernel itself is gone too
        deadline = time.monotonic() + 30
        while _marked_pids(marker) and time.monotonic() < deadline:
            time.sleep(0.5)
    left = _marked_pids(marker)
    print(f"\nnotebook: ran in {run_s:.1f} s; CPU of the kernel and its Ray processes {sampler.total_s:.1f} s "
          f"({len(sampler.seen)} processes)")
    assert not left, f"processes of the notebook's Ray survived it: {left}"

    errors = [out for _, out in _outputs(nb, "error")]
    assert not errors
    # the progress bar is a notebook widget (tqdm.auto inside a kernel), not text
    widgets = [out for _, out in _outputs(nb) if "application/vnd.jupyter.widget-view+json" in out.get("data", {})]
    assert widgets and any("rlflow" in out["data"].get("text/plain", "") for out in widgets)
    text = "".join(out.get("text", "") for _, out in _outputs(nb, "stream"))
    assert "64 train rows, 8 val rows" in text  # the rows in memory follow the tiny settings
    assert "step 2/2" in text and "2 rows" in text  # 2 steps, no validation row (tiny settings)
    images = [out for _, out in _outputs(nb) if "image/png" in out.get("data", {})]
    assert len(images) == 1, "the plot cell draws one figure"
    assert (tmp_path / "outputs" / "rlflow" / "notebook" / "metrics.jsonl").is_file()
