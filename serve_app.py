"""The hvd-ray Ray Serve application.

    serve run serve_app:app                          # default model, suffix drafter, bf16
    serve run serve_app:app drafter=none dtype=float32
    serve run config.yaml                            # args, replicas and resources from the file

``app`` is a Serve *application builder* (one dict argument -> Application): Serve 2.x passes a
config file's ``args`` (or ``serve run``'s ``key=value`` pairs) only to builders, never to an
already built Application. ``default_app`` is the same application with every default, for APIs
that want a built one (``serve.run(default_app)``, ``serve build serve_app:default_app``).
"""

from __future__ import annotations

from ray.serve import Application

from hvd_ray.serving import ServingConfig, build_app


def app(args: dict) -> Application:
    return build_app(args)


default_app = build_app(ServingConfig())

__all__ = ["app", "build_app", "default_app"]
