# Test input, vendored unmodified below this comment: the complete environment of "Your First
# Environment" in verifiers' own docs, docs/legacy/environments.md of
# https://github.com/PrimeIntellect-ai/verifiers at commit a60a606ecc4d309247edf9ff92c3eabca362781f
# (the docs of the classic API, verifiers.legacy, as verifiers 0.3.1 ships it). MIT License,
# Copyright (c) 2026 Prime Intellect.

import verifiers as vf
from datasets import Dataset


def load_environment():
    # Your task data
    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": "What is 2+2?"}], "answer": "4"},
            {"prompt": [{"role": "user", "content": "What is 3*5?"}], "answer": "15"},
        ]
    )

    # Your reward function
    async def correct_answer(completion, answer) -> float:
        response = completion[-1]["content"]
        return 1.0 if answer in response else 0.0

    rubric = vf.Rubric(funcs=[correct_answer])

    return vf.SingleTurnEnv(dataset=dataset, rubric=rubric)
