"""Model keys: one canonical spelling for every way a user names a model.

NDIF names a model by `<class path>:<JSON kwargs>`, e.g.
`nnsight.modeling.language.LanguageModel:{"repo_id": "openai-community/gpt2", "revision": null}`;
that is also our canonical form, so keys, actor names and logs stay compatible with NDIF.
`canonical_model_key()` is pure string work: it never touches the disk or the network.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Iterable
from itertools import islice

from schemas.errors import InvalidCommand
from schemas.guard import body_problem

DEFAULT_MODEL_CLASS = "nnsight.modeling.language.LanguageModel"
# What a load reads from a key (dataplane/replica/model.py): the repo id, and for a repo in the
# cache its revision; every replica is a causal LM, whatever the class. Anything else a key could
# carry would be a second name for the same checkpoint, so it is refused, never kept.
SERVED_CLASSES = frozenset({DEFAULT_MODEL_CLASS})
KEY_FIELDS = ("repo_id", "revision")

# `pkg.module.Class:{...json...}`
_NDIF_KEY = re.compile(r"^(?P<cls>[A-Za-z_][\w.]*):(?P<json>\{.*\})$", re.DOTALL)
# `org/name`, `name`, optionally `@revision`. The rules of huggingface_hub's `validate_repo_id`
# (`huggingface_hub/utils/_validators.py`, the same regex): at most one `/`; namespace and name
# each 1-96 ASCII letters, digits, `_`, `-`, `.`, starting and ending with a letter, digit or `_`;
# no `--`, no `..`; no `.git` at the end. A repo id these refuse crashed the registry's cache
# lookup before (tests/unit/test_reliability_rules.py checks ours against huggingface_hub's).
_REPO_ID = re.compile(r"(\b[\w\-.]{1,96}\b/)?\b[\w\-.]{1,96}\b", re.ASCII)
MAX_KEY_CHARS = 8192  # a class path and a checkpoint path (PATH_MAX is 4096) with room to spare
_KWARGS_DEPTH = 8  # the kwargs are flat; a key nested deeper is not a model key


def _kwargs(text: str, key: str) -> object:
    """The JSON part of an NDIF key, parsed only once bounded (json.loads raises RecursionError on
    deep nesting, which a model key from the wire must never reach): InvalidCommand otherwise."""
    problem = body_problem(text.encode("utf-8", "surrogatepass"), limit=MAX_KEY_CHARS, max_depth=_KWARGS_DEPTH)
    if problem is not None:
        raise InvalidCommand(f"model key {key[:120]!r}: its JSON part is refused ({problem})")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, a number past int's digit limit
        raise InvalidCommand(f"model key {key[:120]!r}: its JSON part does not parse ({exc})") from None


def check_repo_id(repo_id: str) -> str:
    """Refuse (InvalidCommand) a repo id Hugging Face's validator would refuse; return it unchanged."""
    why = None
    if not isinstance(repo_id, str) or not repo_id:
        why = "it is empty"
    elif repo_id.count("/") > 1:
        why = "it has more than one '/' (org/name)"
    elif not _REPO_ID.fullmatch(repo_id):
        why = ("namespace and name must be 1-96 ASCII letters, digits, '-', '_', '.', and start and end "
               "with a letter, digit or '_'")
    elif "--" in repo_id or ".." in repo_id:
        why = "'--' and '..' are not allowed"
    elif repo_id.endswith(".git"):
        why = "it cannot end with '.git'"
    if why is not None:
        shown = repo_id if len(str(repo_id)) <= 120 else f"{str(repo_id)[:117]}..."
        raise InvalidCommand(f"repo id {shown!r} is not a valid Hugging Face repo id: {why}")
    return repo_id


def _dump(cls: str, kwargs: dict[str, object]) -> str:
    ordered = {"repo_id": kwargs["repo_id"], "revision": kwargs.get("revision")}
    # json.dumps' default separators are what NDIF writes: `{"repo_id": "...", "revision": null}`
    return f"{cls}:{json.dumps(ordered, ensure_ascii=False)}"


def _is_path(text: str) -> bool:
    return text.startswith(("/", "./", "../", "~")) or text in (".", "..")


def canonical_model_key(text: str, *, relative: bool = True) -> str:
    """Turn what a user typed into the canonical model key.

    Accepts a repo id (`openai-community/gpt2`, `gpt2@main` for a revision), a local checkpoint
    directory (`/ckpt/tiny`, `./tiny`, `~/tiny`; made absolute) or an NDIF-style key
    (`Class:{"repo_id": ..., "revision": ...}`, re-serialised with a stable field order).
    Raises `InvalidCommand` for empty or unparseable input, and for what a load would ignore
    (another class, fields besides repo_id and revision, a revision on a directory): each would
    be one more name for the same checkpoint. Whether the model exists is decided elsewhere
    (registration resolves it offline, and refuses a second key for a registered checkpoint).

    A relative path (`./tiny`, `~/tiny`) is made absolute against this process's directory and
    user: call this where the user typed it (CLI, admin client, SDK). A service that receives keys
    passes `relative=False`, which refuses a relative path instead of resolving it against its own.
    """
    if not isinstance(text, str) or not text.strip():
        raise InvalidCommand("model key is empty: give a repo id, a checkpoint dir or an NDIF key")
    text = text.strip()
    if len(text) > MAX_KEY_CHARS:
        raise InvalidCommand(f"model key of {len(text)} characters is over the limit of {MAX_KEY_CHARS}")
    m = _NDIF_KEY.match(text)
    if m:
        kwargs = _kwargs(m.group("json"), text)
        if not isinstance(kwargs, dict) or not isinstance(kwargs.get("repo_id"), str) or not kwargs["repo_id"]:
            raise InvalidCommand(f"model key {text!r}: its JSON part needs a non-empty \"repo_id\"")
        rev = kwargs.get("revision")
        if rev == "":  # no revision, as `name` has none (and `name@` is refused)
            rev = kwargs["revision"] = None
        if rev is not None and not isinstance(rev, str):
            raise InvalidCommand(f"model key {text!r}: \"revision\" must be a string or null")
        _loaded_fields_only(m.group("cls"), kwargs, text)
        repo = kwargs["repo_id"]
        if _is_path(repo):
            if rev is not None:
                raise InvalidCommand(f"model key {text[:120]!r}: a local checkpoint directory has no revision "
                                     "(a load reads the directory as it is); drop \"revision\" or name another "
                                     "directory")
            kwargs = {**kwargs, "repo_id": _abs(repo, relative)}
        else:
            check_repo_id(repo)
        return _dump(m.group("cls"), kwargs)
    if _is_path(text):
        return _dump(DEFAULT_MODEL_CLASS, {"repo_id": _abs(text, relative), "revision": None})
    repo, _, rev = text.partition("@")
    if not re.fullmatch(r"[\w.\-/]+", repo) or (rev == "" and "@" in text):
        raise InvalidCommand(
            f"model key {text[:120]!r} is neither a repo id (org/name[@revision]), a path (/…, ./…) "
            "nor an NDIF key (Class:{\"repo_id\": …})"
        )
    check_repo_id(repo)
    return _dump(DEFAULT_MODEL_CLASS, {"repo_id": repo, "revision": rev or None})


def _loaded_fields_only(cls: str, kwargs: dict[str, object], text: str) -> None:
    """Refuse what a load ignores: another class, or fields besides repo_id and revision."""
    if cls not in SERVED_CLASSES:
        raise InvalidCommand(f"model key {text[:120]!r}: class {cls[:80]!r} is not served; every model here loads "
                             f"as {DEFAULT_MODEL_CLASS} (write it so, or give the repo id or directory alone)")
    extra = sorted(k for k in kwargs if k not in KEY_FIELDS)
    if extra:
        shown = ", ".join(repr(k[:40]) for k in extra[:5]) + (" …" if len(extra) > 5 else "")
        raise InvalidCommand(f"model key {text[:120]!r}: {shown} not read by a load (a model is its repo_id and "
                             "revision only); drop them")


def _abs(path: str, relative: bool = True) -> str:
    if not relative and not path.startswith("/"):
        raise InvalidCommand(
            f"checkpoint path {path!r} is relative: it would resolve against the controller's directory, not "
            "yours; send an absolute path (`ndif`, AdminClient and the SDK make it absolute where you type it)")
    return os.path.normpath(os.path.abspath(os.path.expanduser(path)))


def model_parts(model_key: str) -> tuple[str, str, str | None]:
    """Split a canonical key into (class path, repo_id, revision)."""
    m = _NDIF_KEY.match(model_key) if len(model_key) <= MAX_KEY_CHARS else None
    if not m:
        raise InvalidCommand(f"{model_key[:120]!r} is not a canonical model key; pass it through canonical_model_key()")
    kwargs = _kwargs(m.group("json"), model_key)
    if not isinstance(kwargs, dict) or "repo_id" not in kwargs:
        raise InvalidCommand(f"{model_key[:120]!r} is not a canonical model key: its JSON part has no \"repo_id\"")
    return m.group("cls"), str(kwargs["repo_id"]), kwargs.get("revision")


def display_name(model_key: str) -> str:
    """Short name for tables: the repo id (with `@revision` when pinned)."""
    try:
        _, repo, rev = model_parts(model_key)
    except InvalidCommand:
        return model_key
    return f"{repo}@{rev}" if rev else repo


MAX_SUGGEST_FROM = 1000  # models a "did you mean" compares against (difflib is quadratic per pair)


def closest_model(typed: str, known: Iterable[str], *, names_only: bool = False) -> str | None:
    """The known model key a mistyped name most likely meant (a near path or repo id, or the full
    name of a short one), or None. `known` are canonical keys; `typed` is what the user wrote.
    `names_only`: matched on the last part of each name only (what a client is told: a shared
    directory prefix alone is no match)."""
    names = {display_name(k): k for k in islice(known, MAX_SUGGEST_FROM)}
    t = typed.strip().rstrip("/")[:MAX_KEY_CHARS]
    try:
        t = display_name(canonical_model_key(t))
    except InvalidCommand:
        pass
    if t in names:
        return None  # not a typo: the model itself
    last = [n.rsplit("/", 1)[-1] for n in names]
    shorts = {s: n for s, n in zip(last, names, strict=True) if last.count(s) == 1}  # an ambiguous name suggests none
    near = [] if names_only else difflib.get_close_matches(t, list(names), n=1, cutoff=0.8)
    if not near:
        short = difflib.get_close_matches(t.rsplit("/", 1)[-1], list(shorts), n=1, cutoff=0.8)
        near = [shorts[short[0]]] if short else []
    return names[near[0]] if near else None
