"""Benchmark methods by name, each an engine built by ``build_engine`` (the one builder):

``greedy``; a drafter (``suffix``, ``eagle3``, ``layerskip``, ``draft-model``; ``-tree`` for tree
drafts; the suffix drafter also takes ``-f<max_spec_factor>``, ``-o<max_spec_offset>``,
``-p<min_token_prob>``, e.g. ``suffix-tree-f2-p0.05``); ``hvd-<policy>``; ``oracle`` (the live
oracle, ``oracle.LiveOracle``); ``arctic-suffix`` (``peers.ArcticDrafter``); ``via-lossless`` /
``via-tiered`` (the model drafter + the slim tier); ``<method>+slim`` (+ the lossless slim tier) and
``<method>+noreuse`` (without prefix reuse: a prompt is always prefilled whole); ``hvd-<policy>+predictor=DIR``
(another yield predictor artifact than ``--predictor``'s, e.g. an earlier one side by side);
``hvd-<policy>+startup-costs`` (width costs as timed at start-up, never re-fitted from the decoding's
own forwards: ``StepCosts.width_scale``, the behaviour before it).
"""

from __future__ import annotations

from dataclasses import replace

from ..build import build_engine, spec_from_args
from ..engine import Engine
from .oracle import LiveOracle
from .peers import NotRun


def slim_mask(mask: str | None, n_layers: int) -> str:
    """The slim tier's mask: ``mask``, else the shipped DIMR mask; NotRun when there is none."""
    from ..dimr.mask import _shipped

    if mask is None and _shipped(n_layers) is None:
        raise NotRun("no mask: the DIMR mask hvd_ray/assets/slim-smollm2/ is not shipped")
    return mask or "default"


def make_method(name: str, model, tok, args, max_len: int) -> tuple[Engine, LiveOracle | None]:
    """(batch-1 engine, its live oracle or None) of method ``name``. ``args``: the job's parsed
    options (the spec's ``--eagle3-head``, ``--predictor``, ``--model-drafter``, ``--num-draft-tokens``
    and ``--slim-mask``). Raises ValueError for an unknown name, NotRun for a method that cannot run here."""
    from ..drafters import make_drafter
    from ..drafters.suffix import SuffixConfig, SuffixDrafter

    base, *extras = name.split("+")
    model = model.with_own_cache()  # methods side by side must not reuse each other's K/V
    spec = spec_from_args(args, max_batch=1, max_len=max_len)
    drafters, oracle = None, None
    if base in ("via-lossless", "via-tiered"):
        spec = replace(
            spec, drafter=args.model_drafter, slim=slim_mask(args.slim_mask, model.cfg.n_layers), slim_mode=base[4:]
        )
    elif base == "oracle":
        cache = SuffixDrafter()
        drafter = make_drafter(
            args.model_drafter, model, eagle3_head=args.eagle3_head, slots=spec.slots(), max_len=max_len
        )
        drafters, oracle = [cache, drafter], LiveOracle(cache, drafter)
    elif base.startswith("hvd-"):
        spec = replace(spec, drafter="hvd", policy=base[4:])
    elif base == "arctic-suffix":
        from .peers import ArcticDrafter

        drafters = [ArcticDrafter()]
    elif base.startswith("suffix"):
        parts = base.split("-")[1:]

        def opt(key: str, default: float) -> float:
            return next((float(p[1:]) for p in parts if p[:1] == key), default)

        cfg = SuffixConfig(
            use_tree_spec="tree" in parts,
            max_spec_factor=opt("f", SuffixConfig.max_spec_factor),
            max_spec_offset=opt("o", SuffixConfig.max_spec_offset),
            min_token_prob=opt("p", SuffixConfig.min_token_prob),
        )
        spec, drafters = replace(spec, drafter="suffix"), [SuffixDrafter(cfg)]
    elif base.endswith("-tree"):  # tree drafts: a drafter the spec cannot name
        spec = replace(spec, drafter=base[:-5])
        drafters = [
            make_drafter(base[:-5], model, eagle3_head=args.eagle3_head, slots=spec.slots(), max_len=max_len, tree=True)
        ]
    elif base != "greedy":
        spec = replace(spec, drafter=base)
    startup = False
    for extra in extras:
        if extra == "startup-costs" and base.startswith("hvd-"):
            startup = True
        elif extra == "slim":
            spec = replace(spec, slim=slim_mask(args.slim_mask, model.cfg.n_layers), slim_mode="lossless")
        elif extra == "noreuse":
            spec = replace(spec, prefix_reuse=False)
        elif extra.startswith("predictor=") and base.startswith("hvd-"):
            spec = replace(spec, predictor=extra.split("=", 1)[1])
        else:
            raise ValueError(
                f"unknown method suffix {extra!r} in {name!r} ('+slim', '+noreuse', "
                "'+predictor=DIR' and '+startup-costs' for hvd-*)"
            )
    engine = build_engine(spec, model, tok, drafters=drafters, policy=oracle)
    costs = getattr(engine.policy, "costs", None) if startup else None
    if costs is not None:  # its own copy: the costs are shared by the model's engines
        engine.policy.costs = replace(costs, refit=False, rows=dict(costs.rows), fit=[0.0] * 5, width_scale=1.0)
    return engine, oracle
