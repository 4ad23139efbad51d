from glmtune.train.samples import prompts_from


def _rows(n):
    return [{"messages": [{"role": "user", "content": f"t{i}"}, {"role": "assistant", "content": "{}"}]}
            for i in range(n)]


def test_prompts_from_respects_count():
    assert prompts_from(_rows(10), 0) == []
    assert len(prompts_from(_rows(10), 3)) == 3
    prompt, reference = prompts_from(_rows(2), 5)[0]
    assert prompt["messages"][-1]["role"] == "user" and reference == "{}"
