"""Load a model by what the user names: a bundled model, a Hugging Face folder, or a GGUF file."""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import sys
import time
from pathlib import Path

import torch
from torch import nn

from specdraft.errors import SpecdraftError
from specdraft.models import registry
from specdraft.models.causal_lm import CausalLM
from specdraft.models.context import hold_context
from specdraft.models.fast_layers import fast_decoder_layers, held_tensors
from specdraft.models.heap import compact_heap, drop_file_ranges, file_ranges
from specdraft.models.gguf_config import gguf_config
from specdraft.models.gguf_native import family_config
from specdraft.models.prepacked import prepack_linears, unpack_linears
from specdraft.paths import cache_dir, partial_path

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`"bfloat16"` / `"float32"` / `"float16"` (or a torch dtype) to a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype.lower()]
    except KeyError:
        raise SpecdraftError(f"Unknown dtype {dtype!r}; use bfloat16 or float32 (float16 on GPU).") from None


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`None` or "auto" picks CUDA when present, else the CPU."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_model_path(spec: str) -> tuple[str, Path]:
    """Map what the user named to ("gguf" | "folder", path); bundled names are assembled first."""
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise SpecdraftError(f"{spec!r} is a file but not a .gguf file; give a .gguf file or a model folder.")
        return "gguf", path
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpecdraftError(f"{spec!r} is a folder without config.json; give a Hugging Face model folder.")
        return "folder", path
    if spec in registry.BUNDLED_MODELS:
        return "gguf", registry.assemble(registry.get_bundled(spec))
    if "/" in spec or spec.endswith(".gguf"):
        raise SpecdraftError(f"No such file or folder: {spec!r}.")
    registry.get_bundled(spec)  # raises the "unknown model" error listing the bundled names
    raise AssertionError("unreachable")


def load_tokenizer(spec: str):
    """The tokenizer of a model named as `load_model` takes it, without loading its weights."""
    kind, path = resolve_model_path(spec)
    if kind == "gguf":
        return _gguf_config_and_tokenizer(path)[1]
    return _folder_tokenizer(path)


def _folder_tokenizer(folder: Path, **kwargs):
    """The tokenizer saved in `folder` (`AutoTokenizer`, given `kwargs`), lean (`lean_tokenizer`)."""
    from transformers import AutoTokenizer

    return lean_tokenizer(AutoTokenizer.from_pretrained(str(folder), **kwargs))


def lean_tokenizer(tokenizer):
    """`tokenizer` without the Python copies of its vocabulary and merges that transformers 5's tokenizer classes
    keep (`_vocab`, `_merges`) after building their Rust tokenizer from them: only their `__init__` reads them, and
    they hold 56 MB for a 151k-token vocabulary (half of what a loaded Qwen tokenizer holds)."""
    if getattr(tokenizer, "_tokenizer", None) is not None:
        for name in ("_vocab", "_merges"):
            tokenizer.__dict__.pop(name, None)
    return tokenizer


def _converted_dir(gguf_path: Path, kind: str) -> Path:
    """Where something made once from a GGUF file is kept, keyed by the file's identity and `kind`."""
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir() / "converted" / f"{gguf_path.stem}-{key}-{kind}"


def _keep(folder: Path, *savables) -> None:
    """Save each (`save_pretrained`) into `folder` atomically; a failure costs only time later."""
    partial = partial_path(folder)
    try:
        shutil.rmtree(partial, ignore_errors=True)
        for savable in savables:
            savable.save_pretrained(str(partial))
        os.replace(partial, folder)
    except OSError as error:
        if not folder.is_dir():  # else another process kept it first
            print(f"warning: could not keep {folder}: {error}", file=sys.stderr)
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # gone where it was moved into place


_COMPLETED = "config-completed"  # marks a kept config made by `gguf_config` (older ones lack what it adds)


def _gguf_config_and_tokenizer(path: Path):
    """The config and tokenizer a GGUF file describes (read once, then kept in the cache). A kept config is read
    into a plain `PretrainedConfig` that names its family in `model_type` (`gguf_native.family_config` makes it the
    family's class where transformers' model needs that): the family's class would import transformers' model code."""
    from transformers.configuration_utils import PretrainedConfig

    meta = _converted_dir(path, "meta")
    if (meta / "config.json").is_file() and (meta / _COMPLETED).is_file():
        config = PretrainedConfig(**PretrainedConfig.get_config_dict(str(meta))[0])
        return config, _kept_tokenizer(meta, config)
    config = gguf_config(path)
    tokenizer = _gguf_tokenizer(path, config)
    _keep(meta, config, tokenizer)
    try:
        (meta / _COMPLETED).touch()
    except OSError:
        pass  # only costs the parse next time
    return config, tokenizer


def _kept_tokenizer(meta: Path, config):
    """The tokenizer kept in `meta`, as an earlier load pickled it (0.5-0.9 s on 2 cores where building it from
    `tokenizer.json` took 1.2-2.7 s: transformers 5 parses that file in Python several times), else built from the
    folder (`config` given, so that `AutoTokenizer` does not import the family's config class) and pickled for the
    next load. The pickle is named by transformers' version and holds the lean tokenizer (`lean_tokenizer`); one that
    cannot be read costs a build."""
    import transformers

    kept = meta / f"tokenizer-{transformers.__version__}-lean.pickle"
    if kept.is_file():
        try:
            with open(kept, "rb") as file:
                return pickle.load(file)  # our own cache file, written below
        except Exception as error:  # a cut or stale file costs a build, never the load
            print(f"warning: could not read the kept tokenizer {kept} ({error}); building it", file=sys.stderr)
    tokenizer = _folder_tokenizer(meta, config=config)
    partial = partial_path(kept)
    try:
        with open(partial, "wb") as file:
            pickle.dump(tokenizer, file)
        os.replace(partial, kept)
        for older in meta.glob("tokenizer-*.pickle"):  # another transformers' or older code's
            if older != kept:
                older.unlink(missing_ok=True)
    except Exception:  # a full disk, a tokenizer that will not pickle: only costs the build next time
        partial.unlink(missing_ok=True)
    return tokenizer


def _gguf_tokenizer(path: Path, config):
    """The tokenizer a GGUF file describes. For the families the packed path declares, built by the tokenizer
    class transformers registers for the config's model type (TokenizersBackend where none is): `AutoTokenizer`
    would first parse the file's config again with gguf-py (tens of seconds over a large vocabulary)."""
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

    from specdraft.models.architectures import architecture_for

    if architecture_for(config) is None:
        return _folder_tokenizer(path.parent, gguf_file=path.name)
    registered = TOKENIZER_MAPPING_NAMES.get(config.model_type)
    tokenizer_class = (registered and tokenizer_class_from_name(registered)) or TokenizersBackend
    return lean_tokenizer(tokenizer_class.from_pretrained(str(path.parent), gguf_file=path.name))


def _refuse_unread_frequency_factors(path: Path, config) -> None:
    """Transformers' GGUF loader ignores a `rope_freqs` tensor; where the config does not carry the same scaling
    (`gguf_config` recovers Llama 3's), the unpacked model would rotate wrongly: refuse, naming the way out."""
    from specdraft.models.architectures import LONGROPE_FACTORS
    from specdraft.models.gguf_header import read_header
    from specdraft.models.gguf_native import longrope_refusal, reads_longrope

    names = {entry.name.split(".")[0] for entry in read_header(path).tensors}
    if names & set(LONGROPE_FACTORS) and not reads_longrope(config):
        raise SpecdraftError(longrope_refusal(path))
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        return
    if "rope_freqs" in names:
        raise SpecdraftError(f"{path.name} scales its rotary frequencies by a rope_freqs tensor that is not Llama 3's "
                             "scaling; transformers' loader cannot apply it. Load it packed (--gguf-weights auto).")


def _load_gguf_unpacked(path: Path, dtype: torch.dtype):
    """Model and tokenizer from a GGUF file, unpacked to `dtype` by transformers' GGUF loader.

    Unpacking takes most of a minute on 2 cores, so the result is kept once as safetensors
    in the cache folder and later loads read that copy (the same weights, bit for bit).
    """
    from transformers import AutoModelForCausalLM, GgufConfig

    converted = _converted_dir(path, str(dtype).removeprefix("torch."))
    if (converted / "config.json").is_file():
        return (AutoModelForCausalLM.from_pretrained(str(converted), dtype=dtype),
                _folder_tokenizer(converted))
    print(f"unpacking {path.name} to {str(dtype).removeprefix('torch.')} (once; kept in {converted.parent})",
          file=sys.stderr)
    config, tokenizer = _gguf_config_and_tokenizer(path)
    config = family_config(config)
    _refuse_unread_frequency_factors(path, config)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, config=config, dtype=dtype,
        quantization_config=GgufConfig(dequantize=True),
    )
    _keep(converted, model, tokenizer)
    return model, tokenizer


GGUF_WEIGHTS = ("auto", "packed", "unpacked")


def _packed_obstacle(config, device: torch.device) -> str | None:
    """Why the packed GGUF path cannot run this model here, or None when it can."""
    from specdraft.models.gguf_native import packed_obstacle
    from specdraft.models.quantize import int4_kernel_available

    if device.type != "cpu":
        return "the packed kernels run on the CPU"
    if not int4_kernel_available():
        return "this PyTorch build has no CPU int4 kernel"
    return packed_obstacle(config)


def load_model(
    spec: str,
    dtype: str | torch.dtype = "bfloat16",
    device: str | torch.device | None = None,
    verbose: bool = True,
    gguf_weights: str = "auto",
    prepack: bool = True,
    requantized: bool = False,
    max_context: int | None = None,
    clip_context: bool = False,
) -> CausalLM:
    """Load a causal LM: a bundled model name, a Hugging Face folder (safetensors) or a .gguf file.

    GGUF weights (`gguf_weights`): `packed` runs the file's Q4_K and Q6_K blocks on CPU
    kernels and unpacks the rest (see `gguf_native`); `unpacked` turns the whole file into
    `dtype` with transformers' loader; `auto` is packed on the CPU for the architectures it
    supports. `prepack` puts plain bf16 linears on the CPU on oneDNN's prepacked weights
    (`models.prepacked`: same outputs, faster); a model to train keeps PyTorch's (False). `requantized`: the
    caller re-quantizes the model to int4 (a draft, `draft_requantized`), so GGUF types that would run as two
    4-bit halves are unpacked for it instead. `max_context`: the longest sequence (prompt + answer) it holds, fixed
    here (`models.context.hold_context`: above a LongRoPE model's pretraining length, its long rotary factors at every
    position); None: the model's own (a LongRoPE model's pretraining length). `clip_context`: a `max_context` past
    what the model's positions allow holds all they allow instead of being refused (a draft: `ModelDrafter` keeps
    its reads within its positions).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    if gguf_weights not in GGUF_WEIGHTS:
        raise SpecdraftError(f"Unknown GGUF weight mode {gguf_weights!r}; use one of {', '.join(GGUF_WEIGHTS)}.")
    kind, path = resolve_model_path(spec)
    torch_dtype, torch_device = resolve_dtype(dtype), resolve_device(device)
    started = time.perf_counter()
    imported = _import_model_code() if kind != "gguf" or gguf_weights == "unpacked" else 0.0
    hf_logging.set_verbosity_error()  # transformers' notices go nowhere; ours go to stderr
    hf_logging.disable_progress_bar()
    try:
        with compact_heap():
            model, tokenizer, form = _load(spec, kind, path, torch_dtype, torch_device, gguf_weights, not requantized)
            held = hold_context(model, max_context, spec, clip=clip_context)
            model.to(torch_device)
            if prepack:
                prepack_linears(model)
    except SpecdraftError:
        raise
    except (OSError, ValueError, KeyError) as error:
        raise SpecdraftError(f"Could not load {spec!r} as a causal LM: {error}") from error
    finally:
        hf_logging.set_verbosity_warning()
    lm = CausalLM(model, tokenizer, name=spec)
    if verbose:
        importing = f", {imported:.1f}s of it importing transformers' model code" if imported >= 0.5 else ""
        print(f"loaded {spec} ({lm.num_parameters() / 1e6:.0f}M parameters, {form}, {torch_device}"
              f"{', ' + held if held else ''}) in {time.perf_counter() - started:.1f}s{importing}", file=sys.stderr)
    return lm


def _import_model_code() -> float:
    """Import transformers' model code (its configs and model classes), which `import specdraft` leaves out, for a
    model that runs in transformers' class (a packed GGUF model in our own runs without it); the seconds it took (3-5
    on 2 cores the first time in a process, nothing after), for the loading line."""
    started = time.perf_counter()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    from specdraft.models.fast_layers import transformers_parts

    transformers_parts()  # the families' layers our stacked ones stand in for
    return time.perf_counter() - started


def _load(spec: str, kind: str, path: Path, dtype: torch.dtype, device: torch.device, gguf_weights: str,
          split: bool = True):
    """(model, tokenizer, which path runs it and why, in words), built on the CPU for `device`."""
    dtype_name = str(dtype).removeprefix("torch.")
    if kind != "gguf":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        return model, _folder_tokenizer(path), dtype_name
    why = "as asked (--gguf-weights unpacked)"
    if gguf_weights != "unpacked":
        config, tokenizer = _gguf_config_and_tokenizer(path)
        obstacle = _packed_obstacle(config, device)
        if obstacle is None:
            from specdraft.models.gguf_native import build_native_model, describe_packing
            from specdraft.models.packed_model import PackedForCausalLM

            from specdraft.models import packed_store

            kept = packed_store.kept_file(_converted_dir(path, "packed"), dtype, split)
            model = build_native_model(path, config, dtype, split=split, kept=kept)
            shell = "" if isinstance(model, PackedForCausalLM) else f" in transformers' {type(model).__name__}"
            return (model, tokenizer,
                    f"{config.model_type}, GGUF blocks packed{shell}; projections: {describe_packing(model)}")
        if gguf_weights == "packed":
            raise SpecdraftError(f"Cannot load {spec!r} packed: {obstacle}. Use --gguf-weights unpacked.")
        why = f"not packed: {obstacle}"
    return *_load_gguf_unpacked(path, dtype), f"unpacked to {dtype_name} by transformers, {why}"


def check_compatible(target: CausalLM, draft: CausalLM) -> None:
    """Refuse a draft whose vocabulary differs from the target's: its tokens would mean other things."""
    if target.vocab_size != draft.vocab_size:
        raise SpecdraftError(
            f"The draft {draft.name!r} has a vocabulary of {draft.vocab_size} tokens and the target {target.name!r} "
            f"{target.vocab_size}: a draft must share the target's tokenizer. Pick a draft from the target's family."
        )
    if target.tokenizer is not None and draft.tokenizer is not None:
        if target.tokenizer.get_vocab() != draft.tokenizer.get_vocab():
            raise SpecdraftError(
                f"The draft {draft.name!r} and the target {target.name!r} have different tokenizers: "
                "a draft must share the target's vocabulary. Pick a draft from the target's family."
            )


DRAFT_QUANTS = ("auto", "int4", "none")


def draft_requantized(quant: str, device: str | torch.device | None = None) -> bool:
    """Whether `prepare_draft(..., quant)` re-quantizes a draft on `device` to int4 (`auto`: on the CPU where the
    kernel exists); pass it to `load_model(requantized=)`."""
    from specdraft.models.quantize import int4_kernel_available

    if quant == "auto":
        return resolve_device(device).type == "cpu" and int4_kernel_available()
    return quant == "int4"


def _has_codes_to_requantize(model: nn.Module) -> bool:
    """Whether a packed model runs 8-bit (and IQ4) linears as the file stores them or as two 4-bit halves, or 5-bit
    ones as halves (`load_model(requantized=False)`): a draft re-quantizes those to plain 4 bits."""
    from specdraft.kernels import int8_codes
    from specdraft.models.fast_layers import StackedProjection
    from specdraft.models.quantize import SplitInt4Linear

    return any(isinstance(m, (SplitInt4Linear, int8_codes.CodeLinear))
               or (isinstance(m, StackedProjection) and (m.reads_twice or any(
                   matmul is int8_codes.code_matmul for matmul, _ in m.runs)))
               for m in model.modules())


def prepare_draft(draft: CausalLM, quant: str = "auto", copy: bool = False, vocab: int | str = "auto") -> CausalLM:
    """The draft as it will run: `int4` swaps its linears for int4 kernels (CPU), `none` keeps it;
    `vocab` > 0 gives it a head over that many common tokens (see `draft_head`; `auto`: 32,768 on the CPU
    where token counts exist for its tokenizer, else the whole vocabulary).

    `auto` quant is int4 on the CPU where the kernel exists, else none. A draft loaded with its 5- and 8-bit
    GGUF linears split in 4-bit halves is loaded again by its name with them plain (`requantized=True`), held to the
    context it held. A quantized or narrowed draft only proposes differently; output stays exact because q_draft is
    what it sampled from. With `copy`, the given model is left as it was (e.g. for a peer that uses it as is).
    """
    from specdraft.models.draft_head import AUTO, draft_vocab_value, resolved_draft_vocab, restrict_draft_vocab
    from specdraft.models.quantize import quantize_int4
    from specdraft.models.token_counts import token_counts_for

    if quant not in DRAFT_QUANTS:
        raise SpecdraftError(f"Unknown draft quantization {quant!r}; use one of {', '.join(DRAFT_QUANTS)}.")
    if quant == "auto":
        quant = "int4" if draft_requantized(quant, draft.device) else "none"
    vocab = draft_vocab_value(vocab)
    found = token_counts_for(draft.tokenizer) if vocab != 0 and draft.tokenizer is not None else None
    chosen = vocab
    vocab = resolved_draft_vocab(vocab, draft, found is not None)
    if quant == "none" and not vocab:
        return draft
    if quant == "int4" and _has_codes_to_requantize(draft.model):  # reloaded with those linears plain, to re-quantize
        draft = load_model(draft.name, dtype=draft.model.dtype, device=draft.device, verbose=False, requantized=True,
                           max_context=draft.max_context)
        copy = False  # a model of its own already
    import copy as copying

    model = copying.deepcopy(draft.model) if copy else draft.model
    prepared = CausalLM(model, draft.tokenizer, name=draft.name)
    started = time.perf_counter()
    mapped = file_ranges(held_tensors([model]))  # weights mapped from a kept file (`packed_store.read`)
    with compact_heap():
        unpack_linears(model)  # vocabulary narrowing and int4 read plain weights
        if chosen == AUTO and not isinstance(model.get_output_embeddings(), nn.Linear):
            vocab = 0  # a head that is not a plain linear layer stays whole unless narrowing was asked for
        scored = restrict_draft_vocab(prepared, vocab, found[0] if found else None)
        swapped = quantize_int4(model, keep_dense=False) if quant == "int4" else 0
        fast_decoder_layers(model)
        prepack_linears(model)  # what stays bf16 (quant none, a head int4 cannot take)
        # the mapped weights it replaced give their pages back (the mapping lives on for those it keeps): a bf16
        # draft's re-quantized linears left 0.8 GB of file pages resident beside the int4 copies
        held = {start for start, _ in file_ranges(held_tensors([model]))}
        drop_file_ranges([(start, end) for start, end in mapped if start not in held])
    ranked = f" (by {found[1].name}, then lowest ids)" if found and scored < draft.vocab_size else ""
    print(f"draft {draft.name}: {swapped} linears in int4, head over {scored} tokens{ranked} "
          f"({time.perf_counter() - started:.1f}s)", file=sys.stderr)
    tags = [tag for tag in (quant if quant == "int4" else "", f"vocab {scored}" if vocab else "") if tag]
    return CausalLM(model, draft.tokenizer, name=f"{draft.name}[{', '.join(tags)}]")
