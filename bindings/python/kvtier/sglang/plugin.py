"""kvtier's SGLang plugin (entry point group ``sglang.srt.plugins``, declared
by this package): SGLang calls :func:`register` early in every process it
runs (server, schedulers, workers). It installs the shim when
``KVTIER_SGLANG_CONFIG`` is set and does nothing otherwise, so having kvtier
installed changes nothing until it is asked for."""

import os

from ._config import ENV


def register() -> None:
    if os.environ.get(ENV):
        from ._patch import install

        install()
