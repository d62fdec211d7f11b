"""The demo's console: Airflow's output goes to a file, the terminal gets one line per heartbeat and task state."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tasks.orchestration.demo_console import quiet_console


def test_output_goes_to_the_log_and_heartbeats_reach_the_terminal(airflow_db, tmp_path, capfd):
    log = tmp_path / "airflow-run.log"
    with quiet_console("rollout_batch", log):
        os.write(1, b"INFO structured airflow line\n")
        heartbeat = "shard 1: 3/8 rollouts done, 5 calls, 120 tokens (42 tok/s), 0 failure rows, 4 s"
        subprocess.run([sys.executable, "-c", f"import sys; print({heartbeat!r}, file=sys.stderr)"], check=True)
        os.write(2, b"stderr of this process\n")
        time.sleep(1.5)
    terminal = capfd.readouterr().out
    assert f"Airflow's full log: {log}" in terminal
    assert "generate shard 1: 3/8 rollouts done, 42 tok/s" in terminal
    assert "structured airflow line" not in terminal and "stderr of this process" not in terminal
    written = log.read_text()
    assert "INFO structured airflow line" in written and heartbeat in written and "stderr of this process" in written
    print("after the block", flush=True)
    assert "after the block" in capfd.readouterr().out
