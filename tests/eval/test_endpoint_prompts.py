"""--api completions sends the prompt text the in-process path tokenizes: for Llama-3.1's template
that text begins with the tokenizer's <|begin_of_text|> (the endpoint rendered it without the
tokenizer's special tokens, so a served Llama-3 model read another prompt than the in-process
one); for Qwen3 (no bos) and GLM the text is as before."""

from __future__ import annotations

import pytest

from glmtune.data.chat_template import load_chat_template
from glmtune.data.tokenizer import TINY_TOKENIZER_DIR, load_tokenizer
from glmtune.eval.answering import Prompting
from glmtune.eval.endpoint import Endpoint, EndpointOptions, resolve_endpoint
from glmtune.eval.suite import DecodingConfig
from tests.data.chat_format_fixtures import TOOL, build_tokenizer
from tests.eval.hostile_stub import Server, completion

MESSAGES = [{"role": "system", "content": "You triage tickets."}, {"role": "user", "content": "Where is order 7?"}]


def _served_prompt(prompting: Prompting) -> str:
    received = []

    def answer(handler, body):
        received.append(body["prompt"])
        completion("Shipped.")(handler, body)

    options = EndpointOptions(concurrency=1)
    with Server({"order 7": answer}) as server:
        endpoint = Endpoint(resolve_endpoint(server.url, "candidate", options), options)
        try:
            [turn], _ = endpoint.answer([(MESSAGES, [TOOL])], prompting, 0)
        finally:
            endpoint.close()
    assert turn.text == "Shipped." and len(received) == 1
    return received[0]


@pytest.mark.parametrize("name", ["llama3_1", "qwen3", "glm"])
def test_the_served_prompt_is_the_in_process_prompt(name, tmp_path):
    directory = TINY_TOKENIZER_DIR if name == "glm" else tmp_path / name
    if name != "glm":
        build_tokenizer(directory, name, vocab_size=400)
    prompting = Prompting(load_tokenizer(directory), load_chat_template(directory), False, DecodingConfig())
    served = _served_prompt(prompting)
    assert prompting.tokenizer(served, add_special_tokens=False)["input_ids"] == prompting.render(MESSAGES, [TOOL])
    assert served.startswith("<|begin_of_text|>") == (name == "llama3_1")
