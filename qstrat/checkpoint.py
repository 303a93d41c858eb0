"""Safetensors sink: write a refit as an HF checkpoint directory vLLM can load.

The directory gets ``model.safetensors`` (or shards plus ``model.safetensors.index.json``) with
the tensors in wire order, and ``config.json`` with the plan's ``quantization_config``. The plan
is validated before anything is written, and files are written to a temporary directory that is
renamed into place at the end: an error never leaves a half-written checkpoint.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from qstrat.driver import NamedTensors, RefitDriver, _as_dict
from qstrat.plan import RefitPlan

INDEX = "model.safetensors.index.json"


def write_checkpoint(driver: RefitDriver, named_tensors: NamedTensors, out_dir: str | Path,
                     hf_config: Mapping[str, Any] | None = None, shard_bytes: int = 4 << 30,
                     overwrite: bool = False, progress: Any = None) -> RefitPlan:
    """Quantize ``named_tensors`` with ``driver`` and write an HF checkpoint to ``out_dir``.

    Args:
        driver: the refit driver (its config decides formats).
        named_tensors: (HF name, tensor) pairs, any device.
        out_dir: target directory; must not exist unless ``overwrite``.
        hf_config: config.json content to write (default: the driver's ``hf_config``); its
            ``quantization_config`` is replaced by the plan's (removed for a BF16 plan).
        shard_bytes: maximum bytes per safetensors shard.
        overwrite: replace an existing ``out_dir``.
        progress: optional callable ``progress(bytes_done, bytes_total)``.
    Returns: the plan that was written.
    Raises: PlanError (nothing written); FileExistsError; NonFiniteError (nothing written).
    """
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; pass overwrite=True")
    tensors = _as_dict(named_tensors)
    plan = driver.plan(tensors)
    total, done = sum(e.nbytes_out for e in plan.entries), 0
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".qstrat-", dir=out.parent))
    try:
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, t in driver.execute(plan, tensors):
            nbytes = t.numel() * t.element_size()
            if size and size + nbytes > shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t.detach().to("cpu").contiguous()
            size += nbytes
            done += nbytes
            if progress is not None:
                progress(done, total)
        _save_shards(tmp, shards)
        cfg = dict(hf_config if hf_config is not None else driver.hf_config)
        cfg.pop("quantization_config", None)
        if plan.quantization_config is not None:
            cfg["quantization_config"] = plan.vllm_quantization_config()
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / "qstrat_plan.json").write_text(plan.to_json(indent=1))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return plan


def _save_shards(directory: Path, shards: list[dict[str, torch.Tensor]]) -> None:
    if len(shards) == 1:
        save_file(shards[0], str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")


class LazyTensor:
    """A checkpoint tensor known by ``shape`` and ``dtype``; :meth:`load` reads its data.

    The driver plans from shape and dtype alone and calls :meth:`load` only when it quantizes.
    """

    def __init__(self, path: Path, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.path, self.name, self.shape, self.dtype = path, name, torch.Size(shape), dtype

    def load(self) -> torch.Tensor:
        """Read the tensor from its safetensors file (CPU)."""
        from safetensors import safe_open

        with safe_open(str(self.path), framework="pt") as handle:
            return handle.get_tensor(self.name)


def lazy_checkpoint(model_dir: str | Path) -> dict[str, LazyTensor]:
    """Every tensor of a safetensors checkpoint directory as a :class:`LazyTensor` (headers only).

    Raises: FileNotFoundError if the directory has no ``*.safetensors`` file.
    """
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files")
    result = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                sl = handle.get_slice(name)
                result[name] = LazyTensor(f, name, tuple(sl.get_shape()), _SAFETENSORS_DTYPES[sl.get_dtype()])
    return result


def load_checkpoint(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors checkpoint directory (CPU). Used to verify written output."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


_SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8,
    "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64, "BOOL": torch.bool,
    "F8_E8M0": torch.float8_e8m0fnu,
}
