"""Shared fixtures: the real models (fetched once into the cache), the golden reference data, and a cache of the
tests' own for the models they write themselves.

The real models live in the user's cache ($BARELLM_HOME, default ~/.cache/barellm), fetched and converted once
for every run. A model a test writes (tests/tiny_model.py) is loaded with $BARELLM_HOME pointing at a cache of
the session's own (`own_home`; `in_own_home` for a module-scoped fixture that loads one), so that its
conversion, and the name the cache would list it under ("tiny", "base", ...), never land in the user's cache;
`_the_users_cache_gets_no_test_models` fails a test that still puts one there.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from kernel_tiers import ABSENT, PRESENT, using
from kernel_tiers import params as tier_params

from barellm import _native
from barellm.files import home

DATA = Path(__file__).parent / "data"
USERS_HOME = home()   # the cache the real models are in: the environment's, before any test changes it
_SESSION: dict = {}   # what the user's cache indexed at the session's start; the session's temporary folder


def _resolve(name: str, env: str) -> Path:
    override = os.environ.get(env)
    if override:
        return Path(override)
    from barellm.store import hub

    return hub.pull(name, keep_gguf=True, quiet=True)  # the GGUF itself: tests read it with other readers too


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    """Path of the default model's GGUF (SmolLM2-135M-Instruct Q4_1)."""
    return _resolve("smollm2-135m", "BARELLM_SMOLLM_GGUF")


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """Path of the Gemma 3 270M Q4_K_M GGUF."""
    return _resolve("gemma3-270m", "BARELLM_GEMMA_GGUF")


def load_data(name: str):
    """A JSON file from tests/data."""
    with open(DATA / name, encoding="utf-8") as f:
        return json.load(f)


@pytest.fixture(scope="session")
def qwen05_gguf() -> Path:
    """Path of the Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF."""
    return _resolve("qwen2.5-coder-0.5b", "BARELLM_QWEN05_GGUF")


@pytest.fixture(scope="session")
def qwen15_gguf() -> Path:
    """Path of the Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF (the slow tests only: CI does not pull it)."""
    return _resolve("qwen2.5-coder-1.5b", "BARELLM_QWEN15_GGUF")


def plain(metadata: dict) -> dict:
    """Metadata with numeric arrays as lists (the .blm reader hands them over as NumPy views of the file)."""
    return {k: v.tolist() if hasattr(v, "tolist") and not isinstance(v, (str, bytes)) else v
            for k, v in metadata.items()}


def pytest_report_header(config):
    absent = f"; absent, their tests skipped: {', '.join(ABSENT)}" if ABSENT else ""
    return f"kernel tiers run: {', '.join(PRESENT)} (in use: {_native.cpu_info()['isa']}){absent}"


@pytest.fixture(params=tier_params())
def isa(request):
    """Each ISA tier in turn (the kernel tests' parameter); the tier in use is restored after."""
    with using(request.param):
        yield request.param


@pytest.fixture(scope="session")
def scratch_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's own cache: where the models the tests write are converted and named."""
    return tmp_path_factory.mktemp("home")


@pytest.fixture
def own_home(scratch_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """$BARELLM_HOME set to the session's own cache for one test (and the processes it starts)."""
    monkeypatch.setenv("BARELLM_HOME", str(scratch_home))
    return scratch_home


@pytest.fixture(autouse=True)
def _own_models_in_own_home(request: pytest.FixtureRequest) -> None:
    """A test that uses one of its module's OWN_MODELS fixtures (paths of models the module writes) runs with
    own_home; the module's other tests, on the real models, keep the user's cache."""
    if set(getattr(request.module, "OWN_MODELS", ())) & set(request.fixturenames):
        request.getfixturevalue("own_home")


@contextlib.contextmanager
def in_own_home(scratch_home: Path) -> Iterator[None]:
    """$BARELLM_HOME set to the session's own cache while a module-scoped fixture loads a model it wrote."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BARELLM_HOME", str(scratch_home))
        yield


def _test_conversions(basetemp: Path, before: set[str]) -> list[str]:
    """The sources under this session's temporary folder that the user's cache indexes and did not before."""
    index = USERS_HOME / "blm" / "index"
    found = []
    for entry in sorted(set(os.listdir(index)) - before) if index.is_dir() else []:
        try:
            source = json.loads((index / entry).read_text()).get("source", "")
        except (OSError, ValueError, AttributeError):
            continue
        if str(source).startswith(str(basetemp)):
            found.append(str(source))
    return found


def _indexed() -> set[str]:
    index = USERS_HOME / "blm" / "index"
    return set(os.listdir(index)) if index.is_dir() else set()


@pytest.fixture(autouse=True)
def _the_users_cache_gets_no_test_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Fails a test that converted a model it wrote into the user's cache (where it would stay, listed by
    `barellm list` as "tiny" or the like): such a test needs own_home."""
    before = _indexed()
    yield
    _SESSION["basetemp"] = basetemp = tmp_path_factory.getbasetemp()
    leaked = _test_conversions(basetemp, before)
    if leaked:
        pytest.fail(f"converted into the user's cache {USERS_HOME}: {', '.join(leaked)}; a test's own model "
                    "belongs in its own cache (the own_home fixture, OWN_MODELS, in_own_home)", pytrace=False)


def pytest_sessionstart(session: pytest.Session) -> None:
    _SESSION["indexed"] = _indexed()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The same check over the whole session, module-scoped fixtures included."""
    if "basetemp" not in _SESSION or "indexed" not in _SESSION:
        return
    leaked = _test_conversions(_SESSION["basetemp"], _SESSION["indexed"])
    if leaked:
        print(f"\nerror: the tests converted their own models into the user's cache {USERS_HOME}: "
              f"{', '.join(leaked)}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
