"""DIMR on Ray Tune: the sensitivity screen and the mask search, each trial one scored mask.

:class:`SearchProblem` is everything a trial needs, shipped once to each actor. A trial
(``SlimTrial``, a class Trainable with ``reset_config``, run with ``reuse_actors=True``) decodes its
scores into a budget-meeting mask (``space.decode``) and scores it on the calibration set
(``evaluator.SlimEvaluator``); the model and the precomputed calibration set are built once per
actor process and cached there. :func:`run_screen` scores every single-sub-layer drop (the
warm start's sensitivities, ``space.screen_seeds``); :func:`run_search` drives the trials with
``OptunaSearch`` and ``samplers.InterleavedSampler`` and returns the best mask.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .budget import SubLayerCosts
from .calibration import CalibSeq, calib_key
from .cost import DEFAULT_ALPHA, DEFAULT_BETA, check_alpha_beta
from .evaluator import SlimEvaluator
from .mask import SlimMask
from .samplers import InterleavedSampler
from .space import decode, param_name, parse_param, prior_scores

OBJECTIVES = ("r", "kl")
LOCAL_MOVES = ("swap", "gauss", "uniform")


@dataclass
class SearchProblem:
    """Everything a trial needs, shipped once to each actor (``tune.with_parameters``)."""

    model: str
    dtype: str
    device: str
    seqs: list[CalibSeq]
    costs: SubLayerCosts
    budget: float
    objective: str = "r"
    alpha: float = DEFAULT_ALPHA
    beta: float = DEFAULT_BETA
    width: int = 8
    topk: int = 64
    threads: int = 1

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if not 0.0 < self.budget <= 1.0:
            raise ValueError(f"budget must be in (0, 1], got {self.budget}")
        check_alpha_beta(self.alpha, self.beta)

    def space(self) -> dict:
        from ray import tune

        return {param_name(c): tune.uniform(0.0, 1.0) for c in SlimMask.candidates(self.costs.n_layers)}


_EVALUATORS: dict[str, SlimEvaluator] = {}
_SCORED: dict[str, dict] = {}  # mask spec -> metrics, per process: a repeated mask is not re-evaluated


def evaluator_for(problem: SearchProblem) -> SlimEvaluator:
    """The process's evaluator for ``problem`` (model loaded and calibration precomputed once per process)."""
    key = f"{problem.model}|{problem.dtype}|{problem.device}|{problem.width}|{problem.topk}|{calib_key(problem.seqs)}"
    if key not in _EVALUATORS:
        from ..model import Transformer, parse_device, parse_dtype, resolve

        torch.set_num_threads(problem.threads)
        _EVALUATORS.clear()  # one model per process
        _SCORED.clear()
        model = Transformer.from_pretrained(
            resolve(problem.model), dtype=parse_dtype(problem.dtype), device=parse_device(problem.device)
        )
        _EVALUATORS[key] = SlimEvaluator(model, problem.seqs, width=problem.width, topk=problem.topk)
    return _EVALUATORS[key]


def _trial_class():
    import ray
    from ray import tune

    class SlimTrial(tune.Trainable):
        """One trial = decode the scores into a budget-meeting mask, score it on the calibration set."""

        def setup(self, config: dict, problem: SearchProblem | None = None) -> None:
            self.problem = problem
            self.ev = evaluator_for(problem)

        def step(self) -> dict:
            p = self.problem
            if "drop" in self.config:  # sensitivity screen: one sub-layer skipped
                mask = SlimMask(p.costs.n_layers, (parse_param(self.config["drop"]),))
            else:
                mask = decode(self.config, p.costs, p.budget)
            t0 = time.perf_counter()
            key = f"{mask.spec()}|{p.alpha}|{p.beta}"
            if key not in _SCORED:
                _SCORED[key] = self.ev.evaluate(mask.skipped, alpha=p.alpha, beta=p.beta)
            m = _SCORED[key]
            return {
                **m,
                "objective": m[p.objective],
                "kept": p.costs.kept_fraction(mask),
                "spec": mask.spec(),
                "n_skip": len(mask.skip),
                "eval_s": time.perf_counter() - t0,
                "node": ray.get_runtime_context().get_node_id(),  # which Ray node scored it (clusters)
                "done": True,
            }

        def reset_config(self, new_config: dict) -> bool:
            self.config = new_config
            return True

        def save_checkpoint(self, checkpoint_dir: str) -> dict:
            return {}  # a trial is one stateless evaluation: nothing to resume

        def load_checkpoint(self, checkpoint) -> None:
            pass

    return SlimTrial


@dataclass
class SearchResult:
    mask: SlimMask
    metrics: dict
    trials: list[dict]
    wall_s: float


def _trainable(problem: SearchProblem):
    from ray import tune

    return tune.with_resources(tune.with_parameters(_trial_class(), problem=problem), {"cpu": problem.threads})


def run_screen(
    problem: SearchProblem,
    *,
    parallel: int = 1,
    storage: str | None = None,
    verbose: int = 1,
    progress: Callable[[str], None] | None = None,
) -> tuple[dict[str, dict], float]:
    """Score every single-sub-layer drop on Tune (a grid of 2(L−1) trials): name -> metrics, wall s."""
    from ray import tune

    names = [param_name(c) for c in SlimMask.candidates(problem.costs.n_layers)]
    tuner = tune.Tuner(
        _trainable(problem),
        param_space={"drop": tune.grid_search(names)},
        tune_config=tune.TuneConfig(max_concurrent_trials=parallel, reuse_actors=True),
        run_config=tune.RunConfig(
            name=time.strftime("dimr-screen-%Y%m%d-%H%M%S"),
            storage_path=storage,
            verbose=verbose,
            stop={"training_iteration": 1},
        ),
    )
    t0 = time.perf_counter()
    grid = tuner.fit()
    out = {res.config["drop"]: res.metrics for res in grid if not res.error and "objective" in (res.metrics or {})}
    if len(out) != len(names):
        raise RuntimeError(f"sensitivity screen: {len(names) - len(out)} trials failed (see the Tune errors above)")
    if progress:
        top = sorted(out, key=lambda k: out[k]["objective"])[:6]
        progress(
            f"screen: {len(out)} single drops in {time.perf_counter() - t0:.0f} s; least harmful: "
            + ", ".join(f"{k} ({out[k]['objective']:.3f})" for k in top)
        )
    return out, time.perf_counter() - t0


def run_search(
    problem: SearchProblem,
    *,
    trials: int,
    minutes: float | None = None,
    parallel: int = 1,
    startup: int = 20,
    random_every: int = 4,
    seed: int = 0,
    storage: str | None = None,
    verbose: int = 1,
    prior: bool = True,
    seeds: Sequence[dict] = (),
    local: str = "swap",
    local_sigma: float = 0.05,
    progress: Callable[[str], None] | None = None,
) -> SearchResult:
    """DIMR on Ray Tune (Ray must be initialised). Returns the best mask by the problem's objective.

    ``seeds`` (e.g. :func:`screen_seeds`) and, with ``prior``, the layer-skip heuristic are
    evaluated first (``points_to_evaluate``); they count towards ``startup``. ``local`` is the kind of
    interleaved random trial: ``"swap"``, ``"gauss"`` (σ = ``local_sigma``) or ``"uniform"``.
    """
    if local not in LOCAL_MOVES:
        raise ValueError(f"local must be one of {LOCAL_MOVES}, got {local!r}")
    from ray import tune
    from ray.tune.search.optuna import OptunaSearch

    class Progress(tune.Callback):
        best = float("inf")
        n = 0

        def on_trial_result(self, iteration, trials, trial, result, **info):
            self.n += 1
            self.best = min(self.best, result["objective"])
            if progress:
                progress(
                    f"trial {self.n}: {problem.objective}={result['objective']:.4f} kl={result['kl']:.4f} "
                    f"top1={result['top1']:.3f} kept={result['kept']:.3f} best={self.best:.4f}"
                )

    sampler = InterleavedSampler(
        seed,
        startup,
        random_every,
        local_sigma=local_sigma if local == "gauss" else 0.0,
        costs=problem.costs if local == "swap" else None,
        budget=problem.budget,
    )
    searcher = OptunaSearch(
        metric="objective",
        mode="min",
        sampler=sampler,
        points_to_evaluate=([prior_scores(problem.costs.n_layers)] if prior else []) + [dict(x) for x in seeds] or None,
    )
    tuner = tune.Tuner(
        _trainable(problem),
        param_space=problem.space(),
        tune_config=tune.TuneConfig(
            search_alg=searcher,
            num_samples=trials,
            max_concurrent_trials=parallel,
            reuse_actors=True,
            time_budget_s=minutes * 60 if minutes else None,
        ),
        run_config=tune.RunConfig(
            name=time.strftime("dimr-%Y%m%d-%H%M%S"),
            storage_path=storage,
            verbose=verbose,
            callbacks=[Progress()],
            stop={"training_iteration": 1},
        ),
    )
    t0 = time.perf_counter()
    grid = tuner.fit()
    wall = time.perf_counter() - t0
    rows = []
    for res in grid:
        if res.error or not res.metrics or "objective" not in res.metrics:
            continue
        rows.append(
            {
                **{
                    k: res.metrics[k]
                    for k in ("objective", "kl", "r", "top1", "run", "kept", "spec", "n_skip", "eval_s", "node")
                },
                "config": dict(res.config),
            }
        )
    if not rows:
        raise RuntimeError("no DIMR trial finished (see the Tune errors above)")
    best = min(rows, key=lambda r: r["objective"])
    mask = decode(best["config"], problem.costs, problem.budget)
    return SearchResult(mask, best, rows, wall)
