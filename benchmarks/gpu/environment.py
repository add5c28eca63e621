"""The device check's environment step: the machine, torch and the GPU it sees, and which of
the modules reco-megatron uses import (with version, import seconds, and whether the module
came from the carried wheels or from the machine's own Python).

The JSON file is written in stages, each replacing the last atomically: first what needs no
import (Python, platform, CPUs, memory, ``nvidia-smi``), then torch and its GPU, then one
module at a time. A step stopped during a slow import keeps every earlier stage.

    python benchmarks/gpu/environment.py OUT.json
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import subprocess
import sys
import time

from reco_megatron.utils.jsonfile import write_json

MODULES = (
    # what the steps need, in the order they need it; then optional and absent-by-design ones
    "numpy",
    "triton",
    "transformers",
    "safetensors",
    "yaml",
    "megatron.core",
    "psutil",
    "sentencepiece",
    "zmq",
    "msgpack",
    "math_verify",
    "pytest",
    "liger_kernel",
    "tqdm",
    "matplotlib",
    "pyarrow",
    "hypothesis",
    "transformer_engine",
    "apex",
    "vllm",
)
NVIDIA_SMI = (
    "name,memory.total,memory.used,driver_version,clocks.sm,clocks.max.sm,clocks.mem,"
    "temperature.gpu,power.draw,utilization.gpu"
)


def _machine() -> dict:
    out = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "pythonpath": os.environ.get("PYTHONPATH", ""),
        "disk_free_gib": round(shutil.disk_usage(".").free / 2**30, 1),
    }
    try:
        with open("/proc/meminfo") as f:
            out["mem_total_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    if shutil.which("nvidia-smi"):  # a read-only query: the card's settings stay as found
        try:
            proc = subprocess.run(
                ["nvidia-smi", f"--query-gpu={NVIDIA_SMI}", "--format=csv"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            out["nvidia_smi"] = (proc.stdout or proc.stderr).strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            out["nvidia_smi"] = f"{type(exc).__name__}: {exc}"
    return out


def _torch() -> dict:
    start = time.perf_counter()
    import torch

    out = {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_import_s": round(time.perf_counter() - start, 2),
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        start = time.perf_counter()
        props = torch.cuda.get_device_properties(0)
        torch.zeros(1, device="cuda")  # the CUDA context, timed: every step pays it
        out.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            cuda_init_s=round(time.perf_counter() - start, 2),
            cudnn=torch.backends.cudnn.version(),
        )
    return out


def _module(name: str, site: str) -> dict:
    start = time.perf_counter()
    try:
        mod = importlib.import_module(name)
    except Exception as exc:  # report, do not stop: later steps say what it breaks
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    path = os.path.realpath(getattr(mod, "__file__", None) or "")
    return {
        "ok": True,
        "version": str(getattr(mod, "__version__", "?")),
        "import_s": round(time.perf_counter() - start, 2),
        "from": "carried" if site and path.startswith(site) else "machine",
    }


def main(path: str) -> None:
    site = os.path.realpath(os.environ["SITE"]) if os.environ.get("SITE") else ""
    report: dict = {"complete": False, **_machine()}
    write_json(path, report)
    report.update(_torch())
    write_json(path, report)
    report["modules"] = {}
    for name in MODULES:
        report["modules"][name] = _module(name, site)
        write_json(path, report)
    report["not_importable"] = [n for n, m in report["modules"].items() if not m["ok"]]
    report["complete"] = True
    write_json(path, report)
    for key in ("python", "torch", "gpu", "cuda_available", "not_importable"):
        print(f"{key}: {report.get(key)}")


if __name__ == "__main__":
    main(sys.argv[1])
