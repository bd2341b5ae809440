"""Ray Serve deployments: the OpenAI-compatible ingress and the model replica.

``build_app(args)`` returns the Serve application (``config.yaml``'s ``import_path``, so a Ray started
anywhere can import it); ``serve_app.app`` (repo root) exposes it for ``serve run serve_app:app``;
``python -m hvd_ray.serving`` starts a local Ray + Serve on 127.0.0.1:8000 and blocks.
"""

from .app import build_app
from .config import ServingConfig

__all__ = ["ServingConfig", "build_app"]
