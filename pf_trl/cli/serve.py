"""`pf-trl serve [options]`: run the preprocessing service; its flags and main live in
:mod:`preprocess_service.serve`.

Imported lazily (in the functions), so that ``pf_trl`` never imports the service package at module level and the
dependency runs one way: this command -> the service. FastAPI and uvicorn are needed only to run it
(``pip install 'pf-trl[service]'``), not for ``--help``.
"""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``pf-trl serve`` (:func:`preprocess_service.serve.build_parser`)."""
    from preprocess_service.serve import build_parser as service_parser

    return service_parser()


def main(argv: list[str] | None = None) -> int:
    """Run the service (:func:`preprocess_service.serve.main`)."""
    from preprocess_service.serve import main as serve

    return serve(argv)
