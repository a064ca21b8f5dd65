"""CLI: ``predict memory``, ``predict collect-memory``, ``predict eval-memory``.

``predictors/cli.py`` mounts these with :func:`add_subcommands`; ``python -m
predictors.memory.cli ...`` runs them standalone."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import NamedTuple

from ..cli_parser import EXIT_ERROR, PredictArgumentParser
from ..flag_values import flag_type, parse_count
from ..spec.model import ModelSpecError
from ..spec.options import FRAMEWORKS

# the verdict's exit status: 0 fits, 2 does not fit, 3 tight (the margin straddles the card);
# every error exits EXIT_ERROR (1), so 2 only ever means oom
EXIT_CODES = {"fits": 0, "oom": 2, "tight": 3}
EXIT_STATUS = (f"exit status: {EXIT_CODES['fits']} fits, {EXIT_CODES['tight']} tight (the "
               f"margin straddles the usable capacity), {EXIT_CODES['oom']} oom; {EXIT_ERROR} "
               "any error (a usage error, a refused flag, an unknown preset, device or "
               f"precision): {EXIT_CODES['oom']} only ever means oom")

# the models traced from flags alone; any other --model is a preset
MODULE_MODELS = ("mlp", "cnn", "module")
# the kinds of model a flag is read by: mlp, cnn and module by name; a preset as "preset" and
# by its parts ("text", "vision"; "multimodal": both)
KIND_SAID = {"mlp": "mlp", "cnn": "cnn", "module": "module", "preset": "a preset",
             "text": "a preset with a text part", "vision": "a preset with a vision part",
             "multimodal": "a preset with a vision and a text part"}


class ReadBy(NamedTuple):
    """A flag only some kinds of model read: its default (None: none, or the preset's own),
    what it sets and those kinds."""

    default: object
    what: str
    kinds: tuple[str, ...]


# A flag given to a model that does not read it is refused, naming it (it used to be ignored
# without a word), so each of these is None when not given and gets its default here. A new
# kind-specific flag or kind of model is an entry here.
MODEL_FLAGS: dict[str, ReadBy] = {
    "--seq": ReadBy(None, "sequence length", ("text",)),
    "--image-res": ReadBy(None, "image resolution", ("cnn", "vision")),
    "--images-per-sample": ReadBy(None, "text to interleave images with", ("multimodal",)),
    "--input": ReadBy(784, "flat input features", ("mlp",)),
    "--hidden": ReadBy("1024,1024", "hidden widths to set", ("mlp",)),
    "--channels": ReadBy("64,128,256", "conv widths to set", ("cnn",)),
    "--kernel": ReadBy(3, "kernel size to set", ("cnn",)),
    "--classes": ReadBy(10, "class count to set", ("mlp", "cnn")),
    "--activation": ReadBy("relu", "activation to set", ("mlp", "cnn")),
    "--batchnorm": ReadBy(False, "batchnorm to add", ("mlp", "cnn")),
    "--dropout": ReadBy(0.0, "dropout to add", ("mlp",)),
    "--module": ReadBy(None, "factory to load", ("module",)),
    "--input-shape": ReadBy(None, "input shape to set", ("module",)),
    "--last-batch": ReadBy(None, "traced last batch", MODULE_MODELS),
    "--trace": ReadBy(False, "analytical model to trace instead", ("preset",)),
    "--strategy": ReadBy(None, "tensor or pipeline parallelism", ("preset",)),
    "--checkpointing": ReadBy("none", "activation checkpointing to set", ("preset",)),
    "--attention": ReadBy("flash", "attention implementation to set", ("preset",)),
    "--freeze": ReadBy(None, "towers to freeze", ("preset",)),
    "--lora-rank": ReadBy(None, "LLM to put LoRA adapters on", ("text",)),
    "--lora-bits": ReadBy(16, "LLM to put LoRA adapters on", ("text",)),
}
# --strategy's dp<D> and mb<M> replace --dp and --batch: given with it they were dropped
# without a word, so both are None when not given and get these defaults in _model_flags
STRATEGY_REPLACES = {"--batch": 1, "--dp": 1}


def _said(kinds: tuple[str, ...]) -> str:
    """The kinds in words: "mlp, cnn or module"."""
    said = [KIND_SAID[k] for k in kinds]
    return " or ".join([", ".join(said[:-1]), said[-1]] if len(said) > 1 else said)


def _given_or(flag: str, help: str, unset: str | None = None) -> dict:
    """add_argument's default and help for a flag of MODEL_FLAGS: None (not given); the help
    says its real default (``unset`` where that is None) and the kinds that read it."""
    read = MODEL_FLAGS[flag]
    if read.default is not None and not isinstance(read.default, bool):  # a switch's: off
        unset = str(read.default)
    default = "" if unset is None else f"default {unset}; "
    return {"default": None, "help": f"{help} ({default}{_said(read.kinds)} only)"}


def add_subcommands(subparsers) -> None:
    m = subparsers.add_parser("memory", help="predict the peak GPU memory of a training step",
                              epilog=EXIT_STATUS)
    m.add_argument("--model", required=True,
                   help="a preset (e.g. llava-1.5-7b-like), 'mlp', 'cnn' or 'module'")
    # >= 1 at the flag: mlp/cnn/module took a 0 batch (a step of no samples, judged to fit) and
    # crashed on a negative one in torch; presets refuse it later, as micro_batch
    m.add_argument("--batch", type=flag_type(parse_count), default=None,
                   help=f"samples per GPU per step (default {STRATEGY_REPLACES['--batch']}; "
                        "not with --strategy, whose mb<M> it is)")
    g = m.add_argument_group("mlp / cnn / module (traced nn.Module, device-level output)")
    g.add_argument("--input", type=int, **_given_or("--input", "input features"))
    g.add_argument("--hidden", **_given_or("--hidden", "comma list of hidden widths"))
    g.add_argument("--channels", **_given_or("--channels", "comma list of conv widths"))
    g.add_argument("--kernel", type=int, **_given_or("--kernel", "kernel size"))
    g.add_argument("--classes", type=int, **_given_or("--classes", "classifier outputs"))
    g.add_argument("--activation", **_given_or("--activation", "activation after each layer"))
    g.add_argument("--batchnorm", action="store_true",
                   **_given_or("--batchnorm", "batchnorm after each layer"))
    g.add_argument("--dropout", type=float, **_given_or("--dropout", "dropout after each layer"))
    g.add_argument("--module", **_given_or("--module", "package.module:factory"))
    g.add_argument("--input-shape", **_given_or(
        "--input-shape", "one sample's input shape, e.g. 3x224x224 (float input)"))
    g.add_argument("--optimizer", default="adam",
                   help="adam (torch default: foreach), adamw, adamw:fused, sgd:for-loop, ...; "
                        "a preset's analytical model prices Adam(W) in its own implementation "
                        "(fused; foreach under DeepSpeed's ZeRO 2/3): another needs --trace; "
                        "--framework deepspeed and megatron step Adam(W) with their own fused "
                        "kernel (megatron SGD too): another implementation is refused")
    g.add_argument("--device", default=None,
                   help="a100-40gb, a100-80gb, h100-80gb, h200, l40s, v100 (sets capacity "
                        "and, for presets too, the GPU generation's overheads)")
    g.add_argument("--framework", default="pytorch", choices=FRAMEWORKS,
                   help="the traced paths model pytorch (torch DDP), deepspeed (its ZeRO) and "
                        "megatron (distributed optimizer) (default pytorch; beyond --dp 1 a "
                        "preset's analytical model prices the buffers of pytorch (DDP's "
                        "gradient buckets) and megatron (its gradient buffer) and reads "
                        "deepspeed only as its ZeRO 2/3 step with fp32 masters: another needs "
                        "--trace; NCCL's buffers, one communicator per parallel group of more "
                        "than one rank, on every path)")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="Megatron-LM's flag: its gradient buffer in fp32 (--framework megatron "
                        "only; off, as in Megatron-LM, whose --bf16 turns it on: decides the "
                        "buffer of fp16 weights, --precision fp16-mixed)")
    g.add_argument("--json", action="store_true", help="print the named parts as JSON")
    g.add_argument("--last-batch", type=int, **_given_or(
        "--last-batch", "the loader's smaller last batch (len(dataset) %% batch), traced too"))
    g.add_argument("--context-mib", type=float, default=None,
                   help="your stack's measured CUDA context (default: the device's, see docs; "
                        "mlp, cnn, module or a preset with --trace only)")
    g.add_argument("--trace", action="store_true", **_given_or(
        "--trace", "trace the built module (optimizer, device-level output) instead of the "
                   "analytical + LightGBM model"))
    m.add_argument("--seq", type=int, **_given_or(
        "--seq", "text sequence, image tokens included", unset="the preset's own, 2048"))
    # >= 1 at the flag: a preset's vision tower took 0 or a negative multiple of its patch size
    # and priced a model at it (cnn refuses it later, as image_res)
    m.add_argument("--image-res", type=flag_type(parse_count), **_given_or(
        "--image-res", "image resolution", unset="cnn 224, a preset its own"))
    m.add_argument("--images-per-sample", type=int, **_given_or(
        "--images-per-sample", "images each sample's text interleaves",
        unset="the preset's own, 1"))
    m.add_argument("--precision", default="bf16")
    m.add_argument("--zero", type=int, default=0, help="ZeRO / DistributedOptimizer stage")
    m.add_argument("--dp", type=int, default=None,
                   help=f"data-parallel degree ZeRO shards over (default "
                        f"{STRATEGY_REPLACES['--dp']}; not with --strategy, whose dp<D> it is)")
    m.add_argument("--strategy", **_given_or(
        "--strategy", "dp<D>tp<T>pp<P>[mb<M>][gb<G>] as 'predict time' takes it (instead "
                      "of --batch and --dp; the first pipeline stage's rank)"))
    m.add_argument("--checkpointing", choices=["none", "full"],
                   **_given_or("--checkpointing", "activation checkpointing"))
    m.add_argument("--attention", choices=["flash", "unfused", "eager"],
                   **_given_or("--attention", "attention implementation; eager is unfused "
                                                "(transformers' name for it)"))
    m.add_argument("--freeze", **_given_or(
        "--freeze", "comma list of the preset's towers: vision, projector, llm (a vision-only "
                    "preset: vision, head)", unset="the preset's own"))
    m.add_argument("--lora-rank", type=int, **_given_or(
        "--lora-rank", "LoRA adapters of this rank on every Linear of the LLM's layers "
                       "(LLaVA's finetune_lora.sh: 128); the LLM's weights freeze"))
    m.add_argument("--lora-bits", type=int, choices=[16, 4], **_given_or(
        "--lora-bits", "with --lora-rank: 4 keeps the LLM's Linear weights in bitsandbytes' "
                       "nf4 (QLoRA)"))
    m.add_argument("--capacity-gib", default=None,
                   help="card memory in GiB (24/40/80/141...; presets default 80, mlp/cnn/"
                        "module default: --device's)")
    m.add_argument("--margin", type=float, default=None,
                   help="fixed relative margin +-X on the reserved bytes (default: the "
                        "family's calibrated margin)")
    m.set_defaults(func=_named_errors(_memory))

    c = subparsers.add_parser("collect-memory", help="collect ground-truth peak memory")
    c.add_argument("--out", type=Path, default=None)
    c.add_argument("--quick", action="store_true", help="a handful of small configurations")
    c.add_argument("--device", default="sim", choices=["sim", "cuda"],
                   help="sim: fake-tensor trace + allocator simulation; cuda: a real GPU step")
    c.set_defaults(func=_named_errors(_collect))

    e = subparsers.add_parser("eval-memory", help="held-out MAPE + OOM confusion table")
    e.add_argument("--data", type=Path, default=None)
    e.add_argument("--margin", type=float, default=None,
                   help="fixed margin +-X (default: each fold's split-conformal margins, fitted "
                        "on its training rows)")
    e.add_argument("--plot", type=Path, default=Path("out/memory_pred_vs_measured.png"))
    e.set_defaults(func=_named_errors(_eval))


def _named_errors(handler):
    """Bad input exits :data:`EXIT_ERROR` with the error's name and message, however the
    command is mounted."""

    def run(args) -> int:
        try:
            return handler(args)
        except (ModelSpecError, ValueError) as exc:
            print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
            return EXIT_ERROR

    return run


def _model_flags(args) -> None:
    """Refuse the flags of MODEL_FLAGS given to a model that does not read them, naming each
    and what the model lacks; give the flags not given their defaults; then refuse what
    _unread_with finds."""
    from .presets import get_preset

    if args.model in MODULE_MODELS:
        kinds, towers = {args.model}, ()
    else:
        spec = get_preset(args.model)
        kinds = {"preset"} | {part for part, has in (
            ("text", spec.text), ("vision", spec.vision), ("multimodal", spec.multimodal)) if has}
        towers = spec.towers
    defaults = {**{flag: read.default for flag, read in MODEL_FLAGS.items()},
                **STRATEGY_REPLACES}
    dest = {flag: flag[2:].replace("-", "_") for flag in defaults}
    given = {flag for flag in defaults if getattr(args, dest[flag]) is not None}
    unread = [flag for flag, read in MODEL_FLAGS.items()
              if flag in given and not kinds & set(read.kinds)]
    if unread:
        raise ModelSpecError("; ".join(
            f"{flag}: the model {args.model!r} has no {MODEL_FLAGS[flag].what} (only "
            f"{_said(MODEL_FLAGS[flag].kinds)} reads it)" for flag in unread)
            + f"; drop {', '.join(unread)}")
    for flag in defaults.keys() - given:
        setattr(args, dest[flag], defaults[flag])
    if problems := _unread_with(args, kinds, towers, given):
        raise ModelSpecError("; ".join(problems))


def _unread_with(args, kinds: set[str], towers: tuple[str, ...], given: set[str]
                 ) -> list[str]:
    """A flag the model's kind reads but another flag or a value leaves unread (it was dropped
    without a word) or fails on in torch (a message naming no flag): one message each, naming
    the flags. ``args`` has its defaults; ``towers`` the preset's (``ModelSpec.towers``);
    ``given`` the flags of _model_flags given."""
    from .device import unmodelled_zero, unrun_precision

    problems = []
    # the bits of the LLM's weights under LoRA adapters: without them they stay in --precision
    if "--lora-bits" in given and args.lora_rank is None:
        problems.append("--lora-bits: without --lora-rank there are no LoRA adapters and the "
                        "LLM's weights stay in --precision; add --lora-rank or drop --lora-bits")
    if args.lora_rank is not None and args.trace:
        problems.append("--lora-rank: the traced preset path builds no adapters; drop --trace")
    # a preset's analytical model prices the card generation's own CUDA context
    if args.context_mib is not None and "preset" in kinds and not args.trace:
        problems.append(f"--context-mib: the analytical model of {args.model!r} prices the "
                        "device's own CUDA context (only mlp, cnn, module or a preset with "
                        "--trace reads it); add --trace or drop --context-mib")
    # a ZeRO stage neither path models under the framework: the API's own refusal
    if problem := unmodelled_zero(_strategy_options(args)[1]):
        problems.append(problem)
    # a precision the framework runs no job of at the stage: the API's own refusal
    if problem := unrun_precision(_strategy_options(args)[1], args.precision):
        problems.append(problem)
    if "preset" in kinds and not args.trace:
        problems += _unpriced_analytical(args)
    elif problem := _unpriced_impl(args, traced=True):
        problems.append(problem)
    # --strategy's dp<D> and mb<M> were priced and --dp/--batch dropped
    if args.strategy is not None and (replaced := [f for f in STRATEGY_REPLACES if f in given]):
        problems.append(f"{', '.join(replaced)} with --strategy: its mb<M> is the batch and "
                        f"dp<D> the data-parallel degree; drop {', '.join(replaced)} or "
                        "--strategy")
    # a tower the preset lacks froze nothing (mlp/cnn/module were refused --freeze above)
    if missing := [t for t in _frozen(args) or () if t not in towers]:
        problems.append(f"--freeze: the model {args.model!r} has no tower "
                        f"{', '.join(map(repr, missing))} (its towers: {', '.join(towers)})")
    # an mlp's BatchNorm1d normalizes each channel over the batch alone, and torch refuses one
    # value per channel in training; a cnn's BatchNorm2d also takes the >= 2x2 pixels before
    # each pooling, so a cnn trains at batch 1
    if args.model == "mlp" and args.batchnorm:
        problems += [f"{flag} 1 with --batchnorm: an mlp's BatchNorm1d needs 2 or more samples "
                     f"to train (torch refuses 1); give {flag} 2 or more or drop --batchnorm"
                     for flag, batch in (("--batch", args.batch),
                                         ("--last-batch", args.last_batch)) if batch == 1]
    return problems


def _unpriced_analytical(args) -> list[str]:
    """What a preset's analytical model would price otherwise than asked (it was dropped
    without a word, or priced as Adam): an optimizer other than Adam(W), an implementation
    other than the one it prices (:func:`_unpriced_impl`), and a --framework beyond one rank
    whose buffers it does not price (:func:`device.unpriced_framework`, the API's rule).
    One message each, naming the flag. ``args`` has its defaults."""
    from .config import Step
    from .device import unpriced_framework
    from .optimizers import OptimizerSpec

    cfg = Step(*_strategy_options(args), args.precision)
    problems = []
    if OptimizerSpec.parse(args.optimizer).name == "sgd":  # its states are not Adam's two
        problems.append(f"--optimizer {args.optimizer!r}: the analytical model of "
                        f"{args.model!r} prices Adam(W); add --trace to price this optimizer")
    elif problem := _unpriced_impl(args, traced=False):
        problems.append(problem)
    # a framework beyond one rank whose buffers it does not price: the API's own refusal
    if problem := unpriced_framework(cfg):
        problems.append(problem)
    return problems


def _unpriced_impl(args, traced: bool) -> str | None:
    """An --optimizer implementation given explicitly (``adam:foreach``) that the path prices
    as another (it was priced so without a word; a bare ``adam`` names none and is priced in
    the path's own): the traced paths refuse one the framework does not run, pricing its own
    fused kernel (:func:`device.unrun_impl`, the API's rule), a preset's analytical model
    prices its own implementation (:func:`phases.adam_impl`). The one rule for both paths: an
    implementation refused on one is named with the path that prices it, if any. ``args`` has
    its defaults."""
    from .config import Step
    from .device import unrun_impl
    from .optimizers import OptimizerSpec
    from .phases import adam_impl, deepspeed_zero

    opt = OptimizerSpec.parse(args.optimizer)
    impl = opt.impl
    if impl is None:
        return None
    # the framework's own kernel, which the traced paths price, refusing another named
    own = unrun_impl(args.framework, opt)
    if traced and own is None:
        return None
    cfg = Step(*_strategy_options(args), args.precision) if args.model not in MODULE_MODELS \
        else None
    analytical = cfg is not None and impl == adam_impl(cfg)  # the analytical model prices it
    if traced:
        return (f"--optimizer {args.optimizer!r} with --framework {args.framework}: {own}, "
                f"which the traced path prices; drop ':{impl}'" + (
                    " or drop --trace (the analytical model prices DeepSpeed stepping the "
                    "script's torch foreach Adam(W), a config without an \"optimizer\" "
                    "section)" if analytical else ""))
    if analytical:
        return None
    priced = ("torch's foreach Adam(W) on DeepSpeed's ZeRO 2/3 sub-groups"
              if deepspeed_zero(cfg) else "fused Adam(W)")
    return (f"--optimizer {args.optimizer!r}: the analytical model of {args.model!r} prices "
            f"{priced}, not {impl}; " + (f"drop ':{impl}' (--framework {args.framework}: "
                                         f"{own}, which --trace prices)" if own
                                         else f"add --trace to price {impl} or drop ':{impl}'"))


def _frozen(args) -> tuple[str, ...] | None:
    """The towers --freeze names (None: not given, the preset's own)."""
    return None if args.freeze is None else tuple(t for t in args.freeze.split(",") if t)


def _memory(args) -> int:
    _model_flags(args)
    if args.model in MODULE_MODELS:
        return _memory_module(args)
    from .api import predict_peak_memory

    model, strategy, options = _memory_job(args)
    if args.trace:
        return _memory_spec_traced(args, model, strategy, options)
    import json

    from .allocator import GiB
    from .device import get_device

    capacity, architecture = args.capacity_gib or "80", None
    if args.device is not None:  # the card's own capacity (unless given) and generation
        card = get_device(args.device)
        capacity = args.capacity_gib or card.capacity / GiB
        architecture = card.overheads.name
    pred = predict_peak_memory(model, strategy, options, args.precision, capacity,
                               architecture=architecture, margin=args.margin)
    print(json.dumps(pred.as_dict(), indent=1) if args.json else pred.format())
    return EXIT_CODES[pred.judgement.verdict.value]


def _memory_job(args):
    """The model, strategy and options the flags describe (the one vocabulary)."""
    from ..spec import LoraSpec
    from .presets import as_memory_model

    model = as_memory_model(args.model, seq=args.seq, image_res=args.image_res,
                            images_per_sample=args.images_per_sample,
                            attention="unfused" if args.attention == "eager" else args.attention,
                            frozen=_frozen(args),
                            lora=None if args.lora_rank is None else LoraSpec(
                                args.lora_rank, base_bits=args.lora_bits))
    return (model, *_strategy_options(args))


def _strategy_options(args):
    """A preset's strategy and options as the flags give them (the options of mlp, cnn and
    module too)."""
    from ..spec import ParallelStrategy, TrainingOptions

    strategy = (ParallelStrategy.parse(args.strategy) if args.strategy
                else ParallelStrategy(args.dp, 1, 1, micro_batch=args.batch))
    return strategy, TrainingOptions.for_zero_stage(
        args.zero, recompute=args.checkpointing, framework=args.framework,
        accumulate_allreduce_grads_in_fp32=args.accumulate_allreduce_grads_in_fp32)


def _memory_module(args) -> int:
    import json

    from ..spec import ParallelStrategy
    from .module import predict_module_memory
    from .simple import CnnSpec, MlpSpec, load_factory, parse_shape, parse_widths

    if args.model == "mlp":
        spec = MlpSpec(args.input, parse_widths(args.hidden, "hidden"), args.classes,
                       args.activation, args.batchnorm, args.dropout)
        model, (x, y) = spec.build, spec.example(args.batch)
    elif args.model == "cnn":
        spec = CnnSpec(parse_widths(args.channels, "channels"), args.image_res or 224,
                       kernel=args.kernel, classes=args.classes, activation=args.activation,
                       batchnorm=args.batchnorm)
        model, (x, y) = spec.build, spec.example(args.batch)
    else:
        if args.module is None or args.input_shape is None:
            raise ModelSpecError("--model module needs --module package.module:factory and "
                                  "--input-shape")
        model = load_factory(args.module)
        x = torch_empty((args.batch, *parse_shape(args.input_shape)))
        y = torch_empty((args.batch,), long=True)
    device = args.device or {"24": "l40s", "40": "a100-40gb", "141": "h200"}.get(
        str(args.capacity_gib), "h100-80gb")
    capacity = None if args.capacity_gib is None else float(args.capacity_gib)
    pred = predict_module_memory(model, x, y, optimizer=args.optimizer,
                                 precision=args.precision,
                                 strategy=ParallelStrategy(args.dp, 1, 1),
                                 options=_strategy_options(args)[1], device=device,
                                 capacity_gib=capacity, margin=args.margin,
                                 context_mib=args.context_mib, last_batch=args.last_batch)
    print(json.dumps(pred.as_dict(), indent=1) if args.json else pred.format())
    return EXIT_CODES[pred.verdict.value]


def _memory_spec_traced(args, model, strategy, options) -> int:
    import json

    from .module import predict_spec_memory

    device = args.device or {"24": "l40s", "40": "a100-40gb", "141": "h200"}.get(
        str(args.capacity_gib), "h100-80gb")
    pred = predict_spec_memory(model, strategy, options, args.precision, device,
                               optimizer=args.optimizer,
                               capacity_gib=None if args.capacity_gib is None
                               else float(args.capacity_gib), margin=args.margin,
                               context_mib=args.context_mib)
    print(json.dumps(pred.as_dict(), indent=1) if args.json else pred.format())
    return EXIT_CODES[pred.verdict.value]


def torch_empty(shape: tuple[int, ...], long: bool = False):
    import torch

    return torch.empty(shape, dtype=torch.long if long else torch.float32, device="meta")


def _collect(args) -> int:
    from .collect import GROUND_TRUTH_CSV, collect

    out = collect(args.out or GROUND_TRUTH_CSV, quick=args.quick, device=args.device)
    print(f"ground truth ({args.device}) written to {out}")
    return 0


def _eval(args) -> int:
    from predictors.image_path import image_path_problem

    from .collect import GROUND_TRUTH_CSV
    from .evaluate import evaluate, format_report, plot

    if problem := image_path_problem(args.plot, "memory_pred_vs_measured.png"):
        raise ValueError(f"--plot: {problem}")  # before the folds are fitted, not after
    rep = evaluate(args.data or GROUND_TRUTH_CSV, margin=args.margin)
    print(format_report(rep))
    print(f"plot: {plot(rep, args.plot)}")
    print(f"mape_heldout={rep.mape_heldout:.2f}% oom_verdict_accuracy={rep.oom_accuracy:.1f}%")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = PredictArgumentParser(prog="predict")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
