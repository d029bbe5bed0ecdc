"""What every part of `peers.py` shares: the paths and fixed sizes, the
log, the virtual environment it runs in, and the machine's description."""

import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DIR = REPO_ROOT / "scripts" / "golden"
VENV = Path(os.environ.get("KVMESH_PEERS_VENV", str(Path.home() / ".cache" / "kvmesh" / "peers-venv")))
DEFAULT_GGUF = Path(
    os.environ.get("KVMESH_GGUF", str(Path.home() / ".cache" / "kvmesh" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
)
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
# What llama-cpp-python imports beyond the golden stack: it is installed
# with --no-deps (built here), so these are pinned here.
LLAMA_CPP_DEPS = ["diskcache==5.6.3", "typing-extensions>=4.5"]
PEERS = ("kvmesh", "llama.cpp", "transformers")
# What --skip takes: a peer, or a measurement.
SKIPPABLE = PEERS + ("multi-turn", "memory")

# The filler text of `kvmesh bench-engine` (cli/src/bench.rs `filler`): its
# tokens, repeated to length, are every engine's prompt.
FILLER = (
    "The quick brown fox jumps over the lazy dog while the committee reviews "
    "quarterly results, weather reports and 42 unrelated footnotes. "
)
PROMPT_TOKENS = 512
SHORT_PROMPT_TOKENS = 32
BATCH = 16
# kvmesh's options from the command line, set once by `peers.py`'s main:
# "cpu_kernels" (--cpu-kernels, to kvmesh as KVMESH_CPU_KERNELS) and
# "activations" (--activations, KVMESH_ACTIVATIONS); None: kvmesh's default.
KVMESH_OPTIONS = {"cpu_kernels": None, "activations": None}
# A 1-minute load average above this before the run (or above the run's
# own threads after it) means other work shared the cores.
BUSY_LOAD = 0.5
# A share of the run's CPU time the hypervisor gave other tenants (steal)
# above this means a neighbour took the cores (1-3% in the Zen 3 host's
# quieter spells).
BUSY_STEAL = 0.05

T0 = time.time()


def log(msg):
    """Progress, on a terminal only: a log or a pipe gets the tables (and
    every warning and failure, through warn)."""
    if sys.stderr.isatty():
        warn(msg)


def warn(msg):
    print(f"[peers {time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# Setup: the venv (system python, standard library only)
# --------------------------------------------------------------------------------------


def requirements():
    """The golden stack's pins plus llama-cpp-python, one spec a line."""
    lines = (GOLDEN_DIR / "requirements.txt").read_text().splitlines()
    specs = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    return specs + LLAMA_CPP_DEPS + [LLAMA_CPP_PYTHON]


def llama_cpp_cflags():
    """Extra compiler flags for llama.cpp's build on this CPU. Where the CPU
    has AMX tiles, a native build compiles ggml's AMX matmul, which crashes
    on these machines (a general-protection fault at `ldtilecfg` in
    ggml_backend_amx_mul_mat, on the default model too: llama.cpp requests
    the tile-data permission on the main thread only and its tile
    configuration can be optimised away; a known, open llama.cpp bug). GCC
    keeps an explicit -mno-* over what -march=native implies, so the build
    stays native otherwise (AVX-512, VNNI, BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            has_amx = any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        has_amx = False
    return "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" if has_amx else ""


def in_venv():
    return Path(sys.prefix).resolve() == VENV.resolve()


def ensure_venv():
    """Create or reuse the venv, install what is missing, return its python."""
    if VENV.resolve().is_relative_to(REPO_ROOT):
        sys.exit(f"refusing to put the venv inside the repository: {VENV}")
    py = VENV / "bin" / "python"
    if py.exists():
        log(f"reusing the virtual environment {VENV}")
    else:
        log(f"creating a virtual environment {VENV}")
        VENV.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    stamp = VENV / "kvmesh-peers-requirements.txt"
    flags = llama_cpp_cflags()
    want = "\n".join(requirements()) + "\n" + (f"CFLAGS={flags}\n" if flags else "")
    if stamp.exists() and stamp.read_text() == want:
        log("packages already installed (stamp matches)")
        return py
    log(
        "installing with pip: " + " ".join(requirements()) + "\n"
        "  llama-cpp-python builds from source (about 5 minutes on 2 cores); "
        "torch is a large download (about 5 GB installed)"
    )
    subprocess.run([str(py), "-m", "pip", "install", "--upgrade", "pip"], check=True)
    subprocess.run([str(py), "-m", "pip", "install", *requirements()[:-1]], check=True)
    # Built here, never from pip's cache of an earlier build with other flags.
    env = dict(os.environ)
    if flags:
        log(f"llama.cpp is built with {flags} (see llama_cpp_cflags)")
        for var in ("CFLAGS", "CXXFLAGS"):
            env[var] = (env.get(var, "") + " " + flags).strip()
    subprocess.run(
        [str(py), "-m", "pip", "install", "--no-cache-dir", "--force-reinstall", "--no-deps", LLAMA_CPP_PYTHON],
        check=True,
        env=env,
    )
    stamp.write_text(want)
    log("packages installed")
    return py


# --------------------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------------------


def cpu_model():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in have]
    except OSError:
        pass
    return []


def cpu_times():
    """(total, steal) CPU ticks so far from /proc/stat's cpu line (user,
    nice, system, idle, iowait, irq, softirq, steal), or None off Linux."""
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("cpu "):
                ticks = [int(t) for t in line.split()[1:9]]
                return (sum(ticks), ticks[7]) if len(ticks) == 8 else None
    except (OSError, ValueError):
        pass
    return None


def stolen(start, end):
    """The share of the CPU time between two `cpu_times()` readings that the
    hypervisor gave to other tenants; None without both or without time."""
    if not start or not end or end[0] <= start[0]:
        return None
    return round((end[1] - start[1]) / (end[0] - start[0]), 3)


def median_of(run, repeats):
    """One warm-up call of `run`, then the median of `repeats` calls."""
    run()
    return statistics.median(run() for _ in range(repeats))
