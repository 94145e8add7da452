"""The one error type of the GGUF layer: a user mistake, said in one line."""


class GgufError(Exception):
    """A GGUF request that cannot work (missing shard, wrong architecture, missing package...).

    The message is one line, fit for `fastcomm-serve: error: <message>`.
    """


INSTALL_HINT = 'pip install -e ".[gguf]" (from a fastcomm checkout)'


def missing_package(what: str) -> GgufError:
    return GgufError(f"{what} is not installed in this Python environment; it comes with fastcomm's gguf extra: "
                     f"{INSTALL_HINT}")
