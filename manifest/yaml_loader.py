"""Reading YAML: the subset the manifest writer emits, nothing more.

:func:`load_yaml` builds the document from the YAML parser's events with a stack of open
collections (no recursion), refusing anchors, aliases, tags, merge keys and nesting past
:data:`MAX_DEPTH` as their events arrive, so that a hostile manifest can neither expand nor run
code. :mod:`manifest.codec` reads the usual manifest without it (its entry lines are JSON) and
falls back to it for any other layout; the torchsnapshot reader uses it too.
"""

from __future__ import annotations

from typing import Any

import yaml

from manifest.errors import ManifestDecodeError, UnsafeManifestError

# libyaml's C classes when PyYAML has them; the pure-Python ones behave identically.
_Loader: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# The deepest nesting a manifest may hold, the document's own mapping counting as level 1. The
# writer nests at most 7 levels (the document, ``entries``, an entry, its ``shards``, a shard,
# its ``chunks``, a location) and ``metadata`` 4 (its ``strategies``); the limit leaves room for
# fields added later and for files edited by hand, and keeps every walk of a decoded value (the
# JSON decoder's, the field checks', an error message's ``repr``) far from the interpreter's
# recursion limit, whatever the file holds.
MAX_DEPTH = 32

_NULL_TAG = "tag:yaml.org,2002:null"
_BOOL_TAG = "tag:yaml.org,2002:bool"
_INT_TAG = "tag:yaml.org,2002:int"
_FLOAT_TAG = "tag:yaml.org,2002:float"
_STR_TAG = "tag:yaml.org,2002:str"
_MERGE_TAG = "tag:yaml.org,2002:merge"
_NO_KEY = object()  # what an open mapping holds while it waits for its next key
_SHOWN_KEY_CHARS = 200  # of a key quoted in a message


def load_yaml(text: str, source: str = "manifest") -> Any:
    """The one document in YAML ``text``, as plain data (dict, list, str, int, float, bool,
    None), read as the safe loader reads it; ``source`` names the file in error messages.

    The document is built from the parser's events, one at a time, with a stack of the open
    collections: the file's nesting never becomes recursion here, and whatever the writer never
    emits is refused when its event arrives, before anything is built from it. So an alias is
    refused where it stands, instead of sharing a node that later walks would repeat (a file of
    a few hundred KB of aliases reads as millions of locations); a tag (``!!python/...``,
    ``!!binary``, ``!!set``...) is refused instead of constructed; a plain scalar the resolver
    gives a type JSON cannot write (a timestamp) or a merge key (``<<``) is refused; nesting
    past ``MAX_DEPTH`` is refused at the level that passes it.

    Raises:
        UnsafeManifestError: an anchor, alias, tag, merge key, collection as a mapping key,
            plain scalar of another type, or nesting past ``MAX_DEPTH``.
        ManifestDecodeError: the text is not YAML, holds more than one document, or a
            mapping repeats a key.
    """
    loader = _Loader(text)
    try:
        return _build(loader, source)
    except yaml.YAMLError as e:
        # libyaml's scanner reads ahead of the events (up to a simple key's length), and has a
        # nesting limit of its own, far above ours: a deep flow collection can meet it first.
        if "nesting depth" in str(getattr(e, "problem", "")):
            raise UnsafeManifestError(
                f"{source}: nesting deeper than {MAX_DEPTH} levels, which this library never "
                f"writes ({e})"
            ) from None
        raise ManifestDecodeError(f"{source} is not valid YAML: {e}") from None
    finally:
        loader.dispose()


def _build(loader: Any, source: str) -> Any:
    """The document ``loader``'s events describe (``load_yaml``)."""
    get_event = loader.get_event
    stack: list[Any] = []  # the open collections, outermost first
    keys: list[Any] = []  # beside each: a mapping's pending key (or _NO_KEY); None for a list
    root: Any = None
    documents = 0
    while True:
        event = get_event()
        kind = type(event)
        if kind is yaml.ScalarEvent:
            if event.anchor is not None or event.tag is not None:
                raise _refused(event, stack, keys, source)
            # implicit[0]: a plain scalar, typed by the resolver; any other style is a string.
            value = _plain(loader, event, stack, keys, source) if event.implicit[0] else event.value
        elif kind is yaml.MappingStartEvent or kind is yaml.SequenceStartEvent:
            if event.anchor is not None or event.tag is not None:
                raise _refused(event, stack, keys, source)
            if len(stack) >= MAX_DEPTH:
                raise _unsafe(
                    event, stack, keys, source,
                    f"nesting deeper than {MAX_DEPTH} levels, which this library never writes",
                )  # fmt: skip
            value = {} if kind is yaml.MappingStartEvent else []
        elif kind is yaml.MappingEndEvent or kind is yaml.SequenceEndEvent:
            stack.pop()
            keys.pop()
            if keys and keys[-1] is not None:
                keys[-1] = _NO_KEY  # the value of a mapping's key is complete
            continue
        elif kind is yaml.AliasEvent:
            raise _refused(event, stack, keys, source)
        elif kind is yaml.DocumentStartEvent:
            documents += 1
            if documents > 1:
                raise ManifestDecodeError(f"{source} holds more than one YAML document")
            continue
        elif kind is yaml.StreamEndEvent:
            return root
        else:  # the stream's start, a document's end
            continue
        if not stack:
            root = value
        elif keys[-1] is None:
            stack[-1].append(value)
        elif keys[-1] is _NO_KEY:
            if type(value) is dict or type(value) is list:
                raise _unsafe(
                    event, stack, keys, source,
                    "a collection as a mapping key, which this library never writes",
                )  # fmt: skip
            if value in stack[-1]:
                raise ManifestDecodeError(
                    f"{_place(event, stack, keys, source)}: the key {_shown(value)} appears "
                    "twice in one mapping"
                )
            keys[-1] = value
        else:
            # A collection's key stays pending until it is closed: messages name the entry.
            stack[-1][keys[-1]] = value
            if kind is yaml.ScalarEvent:
                keys[-1] = _NO_KEY
        if kind is not yaml.ScalarEvent:
            stack.append(value)
            keys.append(_NO_KEY if type(value) is dict else None)


def _plain(loader: Any, event: Any, stack: list[Any], keys: list[Any], source: str) -> Any:
    """A plain scalar's value, of one of the types a JSON reader would give it (the safe
    loader's resolver and constructors decide which, and the value)."""
    text = event.value
    tag = loader.resolve(yaml.ScalarNode, text, (True, False))
    if tag == _STR_TAG:
        return text
    if tag == _NULL_TAG:
        return None
    if tag == _BOOL_TAG:
        return loader.bool_values[text.lower()]
    if tag in (_INT_TAG, _FLOAT_TAG):
        try:
            return loader.yaml_constructors[tag](loader, yaml.ScalarNode(tag, text))
        except ValueError:  # the resolver's patterns take "0b_" for an int that int() refuses
            raise ManifestDecodeError(
                f"{_place(event, stack, keys, source)}: the plain scalar {_shown(text)} reads "
                "as a number but is none"
            ) from None
    what = "a merge key (<<)" if tag == _MERGE_TAG else f"a plain scalar read as {tag}"
    raise _unsafe(event, stack, keys, source, f"{what}, which this library never writes")


def _refused(event: Any, stack: list[Any], keys: list[Any], source: str) -> UnsafeManifestError:
    """The error for an anchor, alias or tag."""
    if type(event) is yaml.AliasEvent:
        what = f"the YAML alias *{_clip(event.anchor)}"
    elif event.anchor is not None:
        what = f"the YAML anchor &{_clip(event.anchor)}"
    else:
        what = f"the YAML tag {_clip(event.tag)}"
    return _unsafe(event, stack, keys, source, f"{what}, which this library never writes")


def _unsafe(
    event: Any, stack: list[Any], keys: list[Any], source: str, what: str
) -> UnsafeManifestError:
    return UnsafeManifestError(f"{_place(event, stack, keys, source)}: {what}")


def _place(event: Any, stack: list[Any], keys: list[Any], source: str) -> str:
    """Where an event stands, for a message: the file, the entry (when inside ``entries``:
    its logical path), and the line and column."""
    mark = event.start_mark
    at = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "?"
    if len(stack) >= 2 and keys[0] == "entries" and keys[1] not in (None, _NO_KEY):
        return f"{source}: entry {_shown(keys[1])} ({at})"
    if keys and keys[0] not in (None, _NO_KEY):
        return f"{source}: {_shown(keys[0])} ({at})"
    return f"{source} ({at})"


def _clip(text: str) -> str:
    return text if len(text) <= _SHOWN_KEY_CHARS else text[:_SHOWN_KEY_CHARS] + "..."


def _shown(key: Any) -> str:
    return repr(_clip(key)) if type(key) is str else repr(key)
