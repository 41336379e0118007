"""The oracle for common/chat_template.c: Python jinja2 configured exactly as
transformers' apply_chat_template configures it (transformers 5.x,
utils/chat_template_utils.py, checked against its source):

  ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                extensions=[AssistantTracker, loopcontrols])
  filters["tojson"]  = json.dumps(x, ensure_ascii=False, indent=None,
                                  separators=None, sort_keys=False)
  globals: raise_exception (TemplateError), strftime_now, dict, namespace
           (refusing names that start with "_")
  render(messages=..., tools=None, documents=None, add_generation_prompt=...,
         **special_tokens_map, **kwargs)

and the messages prepared as apply_chat_template prepares them: keys whose
value is None dropped, reasoning aliased to "thinking"/"reasoning_content".

Used by make_chat_fixtures.py (committed expectations), test_chat_live.py
(live comparison on the CI machine) and chat_fuzz.py (differential fuzzing).
Needs only jinja2 (no transformers).
"""

import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _Generation(jinja2.ext.Extension):
    """transformers' AssistantTracker without the tracking: renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError("underscore-prefixed namespace attribute")


def make_env():
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def prepare_messages(messages):
    """apply_chat_template's _normalize_chat_messages + _alias_reasoning_fields."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


_ENV = None


def render(template, case):
    """Renders one case {messages, add_generation_prompt, bos_token,
    eos_token, extra} as apply_chat_template(tokenize=False) would.
    Returns (text, None) or (None, error message)."""
    global _ENV
    if _ENV is None:
        _ENV = make_env()
    try:
        tmpl = _ENV.from_string(template)
        kwargs = {}
        for k in ("bos_token", "eos_token"):
            if case.get(k) is not None:
                kwargs[k] = case[k]
        kwargs.update(case.get("extra") or {})
        kwargs.pop("messages", None)
        kwargs.pop("add_generation_prompt", None)
        tools = kwargs.pop("tools", None)
        documents = kwargs.pop("documents", None)
        text = tmpl.render(messages=prepare_messages(case["messages"]), tools=tools,
                           documents=documents,
                           add_generation_prompt=bool(case.get("add_generation_prompt")),
                           **kwargs)
        return text, None
    except RecursionError:
        return None, "RecursionError"
    except Exception as e:  # every jinja2 / Python failure is "an error" to compare
        return None, f"{type(e).__name__}: {e}"
