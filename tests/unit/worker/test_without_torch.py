"""The router, the sidecar and the sim worker run where torch is not installed."""

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).parents[3]

BLOCK_TORCH = """
import sys

class BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is not installed")

sys.meta_path.insert(0, BlockTorch())
"""


def run_without_torch(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH + code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60
    )


def test_commands_import_without_torch():
    done = run_without_torch(
        "import router.router_cmd, router.up_cmd, router.events_cmd, worker.worker_cmd, worker.sidecar_cmd\n"
        "from worker.models import ModelConfig\n"
        "print(ModelConfig().vocab_size)"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "260"


def test_the_torch_engine_asks_for_torch_by_name():
    done = run_without_torch(
        "from router.cli import main\n"
        "main(['worker', '--engine', 'torch', '--port', '0', '--events-endpoint', '', '--replay-endpoint', '',"
        " '--load-endpoint', ''])"
    )
    assert done.returncode != 0
    assert "needs torch" in done.stderr and "kvgate[worker]" in done.stderr
