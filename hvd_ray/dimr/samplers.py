"""Optuna samplers for the DIMR search: TPE interleaved with random trials, uniform or local.

:class:`InterleavedSampler` runs random start-up trials, then TPE with every ``random_every``-th
trial drawn at random (random search interleaved with BO): uniformly, or as a random local move
around the incumbent (:class:`LocalRandomSampler`). Both are module-level classes, not closures,
because Tune pickles the searcher state.
"""

from __future__ import annotations

import random

import optuna

from .budget import SubLayerCosts
from .space import decode, param_name


class LocalRandomSampler(optuna.samplers.BaseSampler):
    """Random search around the incumbent (the best finished trial): a random local move.

    With ``costs`` and ``budget`` a move is one or two random *swaps*: a kept and a skipped
    sub-layer of the incumbent's mask exchange scores, so :func:`~hvd_ray.dimr.space.decode` skips
    the one and keeps the other (the classic neighbourhood of subset selection). Without them it
    adds N(0, σ²) noise to the incumbent's scores. Uniform while no trial has finished.
    """

    def __init__(
        self, sigma: float = 0.05, seed: int = 0, costs: SubLayerCosts | None = None, budget: float | None = None
    ) -> None:
        self.sigma, self.rng = sigma, random.Random(seed)
        self.costs, self.budget = costs, budget
        self.uniform = optuna.samplers.RandomSampler(seed=seed)

    @staticmethod
    def _best(study) -> dict:
        try:
            return study.best_trial.params
        except ValueError:  # nothing finished yet
            return {}

    def infer_relative_search_space(self, study, trial):
        if self.costs is None:
            return {}
        try:
            return dict(study.best_trial.distributions)
        except ValueError:
            return {}

    def sample_relative(self, study, trial, search_space):
        x = dict(self._best(study))
        if not search_space or set(x) != set(search_space):
            return {}
        skipped = [param_name(c) for c in decode(x, self.costs, self.budget).skip]
        kept = sorted(set(x) - set(skipped))
        if not skipped or not kept:
            return {}
        for _ in range(1 + (self.rng.random() < 0.5)):
            a, b = self.rng.choice(kept), self.rng.choice(skipped)
            x[a], x[b] = x[b], x[a]
        return x

    def sample_independent(self, study, trial, param_name, param_distribution):
        best = self._best(study)
        if param_name not in best:
            return self.uniform.sample_independent(study, trial, param_name, param_distribution)
        v = best[param_name] + self.rng.gauss(0.0, self.sigma)
        return min(param_distribution.high, max(param_distribution.low, v))


class InterleavedSampler(optuna.samplers.BaseSampler):
    """TPE after ``startup`` trials (uniform random ones, TPE's own start-up), with every
    ``random_every``-th later trial a random one: uniform, or a random local move around the
    incumbent (:class:`LocalRandomSampler`: swaps when ``costs``/``budget`` are given, else Gaussian
    noise of ``local_sigma``).
    """

    def __init__(
        self,
        seed: int = 0,
        startup: int = 20,
        random_every: int = 4,
        multivariate: bool = True,
        local_sigma: float = 0.0,
        costs: SubLayerCosts | None = None,
        budget: float | None = None,
    ) -> None:
        self.startup, self.random_every = startup, random_every
        self.tpe = optuna.samplers.TPESampler(n_startup_trials=startup, seed=seed, multivariate=multivariate)
        local = local_sigma > 0 or costs is not None
        self.rand = (
            LocalRandomSampler(local_sigma, seed + 1, costs, budget)
            if local
            else optuna.samplers.RandomSampler(seed=seed + 1)
        )

    def _pick(self, trial) -> optuna.samplers.BaseSampler:
        n, k = trial.number, self.random_every
        if n >= self.startup and k > 0 and (n - self.startup) % k == k - 1:
            return self.rand
        return self.tpe

    def infer_relative_search_space(self, study, trial):
        return self._pick(trial).infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space):
        return self._pick(trial).sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution):
        return self._pick(trial).sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study, trial):
        self._pick(trial).before_trial(study, trial)

    def after_trial(self, study, trial, state, values):
        self._pick(trial).after_trial(study, trial, state, values)
