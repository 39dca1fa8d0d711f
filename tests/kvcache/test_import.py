import subprocess
import sys


def test_kvcache_never_imports_torch():
    code = "import sys, kvserve.kvcache; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
