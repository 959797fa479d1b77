"""``data.chat_template``: inline Jinja, a template file, or one of the named templates below.

The named templates are data, each written after its source:

* ``chatml``: ChatML as OpenAI specified it and Qwen, Hermes and Axolotl's ``chatml`` use it
  (``<|im_start|>role\\ncontent<|im_end|>\\n``).
* ``zephyr``: the template of the alignment handbook's zephyr-7b-beta recipes
  (recipes/zephyr-7b-beta/sft/config_full.yaml, its ``chat_template``).
* ``llama3``: Axolotl's ``llama3`` (src/axolotl/utils/chat_templates/templates/llama3.jinja), the
  Llama 3 Instruct format without its tool-calling part.
* ``tokenizer_default``: the tokenizer's own template (as Axolotl's name), refused if it has none.
"""

from __future__ import annotations

from pathlib import Path

from engine.errors import ConfigError

CHAT_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    "zephyr": (
        "{% for message in messages %}\n"
        "{% if message['role'] == 'user' %}\n"
        "{{ '<|user|>\n' + message['content'] + eos_token }}\n"
        "{% elif message['role'] == 'system' %}\n"
        "{{ '<|system|>\n' + message['content'] + eos_token }}\n"
        "{% elif message['role'] == 'assistant' %}\n"
        "{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
        "{% endif %}\n"
        "{% if loop.last and add_generation_prompt %}\n"
        "{{ '<|assistant|>' }}\n"
        "{% endif %}\n"
        "{% endfor %}"),
    "llama3": (
        "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
        "{% set loop_messages = messages %}{% for message in loop_messages %}"
        "{% if message['content'] is string %}{% set message_text = message['content'] | trim %}"
        "{% else %}{% set message_text = message['content'] | selectattr('text', 'defined') | "
        "map(attribute='text') | join('') | trim %}{% endif %}"
        "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message_text + "
        "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
        "{{ content }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}\n"),
}
# the token a named template ends each turn with, where it is not the tokenizer's eos: generation stops at eos
TURN_ENDS = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}
TOKENIZER_DEFAULT = "tokenizer_default"
KNOWN_NAMES = (*CHAT_TEMPLATES, TOKENIZER_DEFAULT)


def is_inline(value: str) -> bool:
    return "{%" in value or "{{" in value


def resolve_chat_template(value: str) -> str | None:
    """The Jinja text ``data.chat_template`` names (None for ``tokenizer_default``: the tokenizer's own),
    checked for syntax; a missing file or an unknown name is a one-line error."""
    key = "data.chat_template"
    if is_inline(value):
        text = value
    elif value in CHAT_TEMPLATES:
        text = CHAT_TEMPLATES[value]
    elif value == TOKENIZER_DEFAULT:
        return None
    elif Path(value).expanduser().is_file():
        try:
            text = Path(value).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{key}: cannot read the template file {value}: {exc}") from None
        key = f"{key} ({value})"
    elif Path(value).expanduser().is_dir():  # TRL's chat_template_path may name a tokenizer to clone
        example = Path(value) / "chat_template.jinja"
        raise ConfigError(f"{key}: {value} is a folder; name its template file (e.g. {example}), and set "
                          "data.eos_token and data.added_tokens to the tokens that tokenizer adds")
    elif Path(value).suffix in (".jinja", ".j2", ".txt") or "/" in value:
        raise ConfigError(f"{key}: template file not found: {value}")
    else:
        raise ConfigError(f"{key}: unknown template name {value!r}; known names: {', '.join(KNOWN_NAMES)}; "
                          "it may also be inline Jinja (holding '{%' or '{{') or the path of a template file")
    check_syntax(text, key)
    return text


def check_syntax(text: str, key: str) -> None:
    """Refuse a template Jinja cannot parse, naming the line (compiled as transformers compiles chat templates)."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template  # its own extensions: {% generation %}

    if not text.strip():
        raise ConfigError(f"{key}: the chat template is empty")
    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"{key}: the chat template does not parse: line {exc.lineno}: {exc.message}") from None
