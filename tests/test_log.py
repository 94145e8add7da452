"""FASTCOMM_LOG sets the 'fastcomm' logger's level, and records reach stderr as `fastcomm INFO ...` unless the
application configured logging (vLLM does: then nothing is added, so nothing prints twice)."""
import logging

import pytest


class _Empty(list):
    """A root handler list that stays empty while pytest adds its own to it, and gives them back on restore."""

    def __init__(self, real):
        super().__init__()
        self.real = real

    def append(self, handler):
        self.real.append(handler)

    def __contains__(self, handler):
        return handler in self.real

    def remove(self, handler):
        self.real.remove(handler)

from fastcomm import log
from fastcomm.config import Config


@pytest.fixture
def bare_logging(monkeypatch):
    """No handler anywhere, as in a plain script; restores the logger afterwards. (pytest adds its capture
    handlers to the root logger when the test body starts, after fixtures: they are removed then.)"""
    logger = logging.getLogger("fastcomm")
    root = logging.getLogger()
    real = root.handlers
    monkeypatch.setattr(root, "handlers", _Empty(real))
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", True)
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    return logger


def test_info_prints_like_nccl_debug(bare_logging, capsys):
    log.setup(Config.from_env({"FASTCOMM_LOG": "info"}))
    bare_logging.info("fastcomm: %d ranks, transport %s", 2, "p2p")
    bare_logging.debug("not shown")
    assert capsys.readouterr().err == "fastcomm INFO 2 ranks, transport p2p\n"


def test_default_is_warnings_only(bare_logging, capsys):
    log.setup(Config.from_env({}))
    bare_logging.info("quiet")
    bare_logging.warning("fastcomm: loud")
    assert capsys.readouterr().err == "fastcomm WARNING loud\n"


def test_off_silences_everything(bare_logging, capsys):
    log.setup(Config.from_env({"FASTCOMM_LOG": "off"}))
    bare_logging.error("nothing")
    assert capsys.readouterr().err == ""


def test_setup_is_idempotent(bare_logging, capsys):
    for _ in range(3):
        log.setup(Config.from_env({"FASTCOMM_LOG": "debug"}))
    bare_logging.debug("once")
    assert capsys.readouterr().err == "fastcomm DEBUG once\n" and len(bare_logging.handlers) == 1


def test_an_application_s_handlers_are_left_to_print(bare_logging, capsys):
    seen = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logging.getLogger().handlers = [Collect()]
    log.setup(Config.from_env({"FASTCOMM_LOG": "info"}))
    bare_logging.info("fastcomm: via the application")
    assert seen == ["fastcomm: via the application"] and capsys.readouterr().err == ""
    assert bare_logging.handlers == [] and bare_logging.level == logging.INFO


def test_a_handler_configured_later_takes_over(bare_logging, capsys):
    log.setup(Config.from_env({"FASTCOMM_LOG": "info"}))
    seen = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logging.getLogger().handlers = [Collect()]
    log.setup(Config.from_env({"FASTCOMM_LOG": "info"}))  # the next workspace build
    bare_logging.info("x")
    assert seen == ["x"] and capsys.readouterr().err == ""
