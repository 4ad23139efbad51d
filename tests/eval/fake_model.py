"""A stand-in for `glmtune.generation.generate` that answers from the prompt's text, for tests
that must reach the scoring path with a model output no small trained model writes (a tool
call nested 1000 deep, a generation that raises for one prompt).

    fake = FakeGenerate(tokenizer, {"deep please": DEEP_CALL, "explode": RuntimeError("cuda said no")})
    monkeypatch.setattr("glmtune.eval.backends.generate", fake)

Each prompt is decoded and the answer is the one whose key its last user turn contains (an
exception there is raised for the whole call, as a real batch failure is); other prompts get
`default`.
"""

from __future__ import annotations

from glmtune.generation.generator import GenerationResult

# A call whose untyped argument is JSON nested 1000 deep: json.loads raises RecursionError on it.
DEEP_ARGUMENT = "[" * 1000 + "]" * 1000
DEEP_CALL = (f"<tool_call>lookup_order<arg_key>order_id</arg_key><arg_value>ORD-10005</arg_value>"
             f"<arg_key>filters</arg_key><arg_value>{DEEP_ARGUMENT}</arg_value></tool_call>")


class FakeGenerate:
    def __init__(self, tokenizer, answers: dict, default: str = '{"product": "PayFlow"}') -> None:
        self.tokenizer, self.answers, self.default = tokenizer, answers, default
        self.calls: list[int] = []  # batch sizes, in call order

    def _answer(self, prompt: list[int]):
        last_user = self.tokenizer.decode(prompt).split("<|user|>")[-1]
        return next((a for key, a in self.answers.items() if key in last_user), self.default)

    def __call__(self, model, prompts, max_new_tokens, **options) -> GenerationResult:
        self.calls.append(len(prompts))
        answers = [self._answer(p) for p in prompts]
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        ids = [self.tokenizer.encode(a, add_special_tokens=False)[:max_new_tokens] for a in answers]
        return GenerationResult(ids, answers, ["stop_token"] * len(prompts), sum(map(len, prompts)),
                                sum(map(len, ids)), 0.0, 0.0)
