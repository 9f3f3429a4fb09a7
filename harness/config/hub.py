"""Hugging Face hub names (a tokenizer, a model, a dataset) where the hub cannot be reached.

Unless HF_HUB_OFFLINE is set, huggingface_hub retries a connection that fails, with backoff:
tens of seconds before transformers or datasets gives up on a name. So before a hub name is
loaded, the hub is probed once a process (bounded by PROBE_S); offline, a name in the local
Hugging Face cache loads from it alone, and one that is not is one line at once, naming the
cause and the local alternative. The tokenizer, model and data loaders (harness/data,
harness/models.py) both read this, so it sits below them.
"""

from __future__ import annotations

import threading
from functools import lru_cache

from harness.errors import UserError, brief

PROBE_S = 2.0  # a reachable hub answers a HEAD well within this


@lru_cache(maxsize=1)
def offline() -> str | None:
    """Why the hub cannot be reached (HF_HUB_OFFLINE, or no answer to a probe); None when
    it can."""
    from huggingface_hub import constants, get_session

    if constants.HF_HUB_OFFLINE:
        return "offline: HF_HUB_OFFLINE is set"
    failed: list[BaseException | None] = []

    def probe() -> None:  # any answer, even an error status, is a reachable hub
        try:
            get_session().head(constants.ENDPOINT, timeout=PROBE_S)
            failed.append(None)
        except Exception as e:  # httpx's connect, DNS and timeout errors alike
            failed.append(e)

    thread = threading.Thread(target=probe, daemon=True, name="hub-probe")
    thread.start()
    thread.join(PROBE_S)  # name resolution is not bounded by the request's timeout
    if failed and failed[0] is None:
        return None
    why = brief(failed[0]) if failed else f"no answer within {PROBE_S:g} s"
    return f"offline: no connection to {constants.ENDPOINT}: {why}"


def in_cache(name: str, files: tuple[str, ...], repo_type: str = "model") -> bool:
    """Whether one of `files` of the hub repository `name` is in the local cache."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return any(isinstance(try_to_load_from_cache(name, f, repo_type=repo_type), str)
                   for f in files)
    except Exception:  # not a valid repository id: nothing of it can be cached
        return False


def cache_only(key: str, name: str, files: tuple[str, ...], local: str) -> bool:
    """Whether `name` must load from the local cache alone (the hub cannot be reached and it
    is there); UserError (one line, at once) when it cannot be reached and is not there.
    `local`: what to give instead, for the message."""
    reason = offline()
    if reason is None:
        return False
    if in_cache(name, files):
        return True
    raise not_cached(key, name, reason, local)


def not_cached(key: str, name: str, reason: str, local: str) -> UserError:
    return UserError(f"{key}: '{name}' is not in the local Hugging Face cache and the hub "
                     f"cannot be reached ({reason}); {local}")
