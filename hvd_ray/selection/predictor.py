"""The yield predictor g_θ: a small ReLU MLP regressing the cache draft's accepted length from φ_t.

Trained with scikit-learn (``jobs/train_predictor.py``), served with plain numpy: the artifact is
a folder holding ``predictor.npz`` (weights and biases, float64, loaded with
``allow_pickle=False``) and ``predictor.json`` (format version, the :class:`FeatureSpec`, the
standardisation mean/scale, layer sizes, training metadata). No pickle anywhere, so an artifact
can be inspected, diffed and loaded without running code from it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .features import SPEC, FeatureSpec

ARTIFACT_VERSION = 1
WEIGHTS_FILE, META_FILE = "predictor.npz", "predictor.json"


class YieldPredictor:
    """``predict(phi)``: ŷ for one φ (1-D, returns a float) or a batch (2-D, returns an array)."""

    def __init__(
        self,
        weights: Sequence[np.ndarray],
        biases: Sequence[np.ndarray],
        mean: np.ndarray,
        scale: np.ndarray,
        spec: FeatureSpec = SPEC,
        meta: dict | None = None,
    ):
        if len(weights) != len(biases) or not weights:
            raise ValueError("need one bias per weight matrix")
        self.spec, self.meta = spec, dict(meta or {})
        self.weights = [np.asarray(w, np.float64) for w in weights]  # [in, out], sklearn's layout
        self.biases = [np.asarray(b, np.float64) for b in biases]
        self.mean = np.asarray(mean, np.float64)
        self.inv_scale = 1.0 / np.asarray(scale, np.float64)
        if self.weights[0].shape[0] != len(spec) or self.mean.shape != (len(spec),):
            raise ValueError(f"weights expect {self.weights[0].shape[0]} features, spec has {len(spec)}")
        # single-vector path: W^T contiguous, so each layer is one matrix-vector product
        self._wt = [np.ascontiguousarray(w.T) for w in self.weights]

    # ------------------------------------------------------------------ inference
    def predict(self, phi):
        x = np.asarray(phi, np.float64)
        if x.ndim == 1:
            h = (x - self.mean) * self.inv_scale
            last = len(self._wt) - 1
            for i, (wt, b) in enumerate(zip(self._wt, self.biases)):
                h = wt @ h + b
                if i < last:
                    np.maximum(h, 0.0, out=h)
            return float(h[0])
        h = (x - self.mean) * self.inv_scale
        for i, (w, b) in enumerate(zip(self.weights, self.biases)):
            h = h @ w + b
            if i < len(self.weights) - 1:
                np.maximum(h, 0.0, out=h)
        return h[:, 0]

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_sklearn(
        cls, mlp, mean: np.ndarray, scale: np.ndarray, spec: FeatureSpec = SPEC, meta: dict | None = None
    ) -> YieldPredictor:
        """From a fitted ``MLPRegressor`` (ReLU hidden layers, identity output) and the
        ``StandardScaler`` statistics it was trained behind."""
        if getattr(mlp, "activation", "relu") != "relu" or getattr(mlp, "out_activation_", "identity") != "identity":
            raise ValueError("only ReLU MLPs with an identity output are supported")
        return cls(mlp.coefs_, mlp.intercepts_, mean, scale, spec, meta)

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        arrays = {f"w{i}": w for i, w in enumerate(self.weights)}
        arrays.update({f"b{i}": b for i, b in enumerate(self.biases)})
        arrays["mean"], arrays["scale"] = self.mean, 1.0 / self.inv_scale
        np.savez(folder / WEIGHTS_FILE, **arrays)
        meta = {
            "format": "hvd_ray.yield_predictor",
            "version": ARTIFACT_VERSION,
            "feature_spec": self.spec.to_dict(),
            "activation": "relu",
            "layers": [list(w.shape) for w in self.weights],
            "scaler": {"mean": self.mean.tolist(), "scale": (1.0 / self.inv_scale).tolist()},
            "meta": self.meta,
        }
        (folder / META_FILE).write_text(json.dumps(meta, indent=1))
        return folder

    @classmethod
    def load(cls, path: str | Path, spec: FeatureSpec | None = SPEC) -> YieldPredictor:
        """Load an artifact folder (or its ``predictor.json``); checks the feature spec against
        ``spec`` (the code's) unless ``spec`` is None."""
        path = Path(path)
        folder = path.parent if path.is_file() else path
        meta = json.loads((folder / META_FILE).read_text())
        if meta.get("format") != "hvd_ray.yield_predictor" or meta.get("version") != ARTIFACT_VERSION:
            raise ValueError(f"{folder} is not a version-{ARTIFACT_VERSION} yield predictor artifact")
        art_spec = FeatureSpec.from_dict(meta["feature_spec"])
        if spec is not None:
            spec.check(art_spec)
        with np.load(folder / WEIGHTS_FILE, allow_pickle=False) as z:
            n = len(meta["layers"])
            weights = [z[f"w{i}"] for i in range(n)]
            biases = [z[f"b{i}"] for i in range(n)]
            mean, scale = z["mean"], z["scale"]
        return cls(weights, biases, mean, scale, art_spec, meta.get("meta", {}))


__all__ = ["ARTIFACT_VERSION", "YieldPredictor"]
