#!/usr/bin/env python3
"""A conversation continued by `previous_response_id` through `kvchat serve`'s Responses API,
against the same conversation sent whole to /v1/chat/completions, with the official openai client.

  target/pyenv/bin/python scripts/responses-turns.py BASE_URL [--turns 10] [--max-tokens 40]

BASE_URL is a running server (http://127.0.0.1:PORT). The first turn's input holds a ~1,000-token
developer message (a library's lending rules) and a question; each later turn sends only its
question and the previous response's id. Per turn it reports the Responses answer, the chat
completion's answer to the whole conversation, the prompt's tokens (`input_tokens`) and how many
came from memory or the prefix store (`input_tokens_details.cached_tokens`). The last turn is
streamed. stdout holds only the JSON report.
"""
import argparse
import json

import openai

QUESTIONS = [
    "How many days are books in section 3 lent for?",
    "And books in section 7?",
    "How many times can books in section 10 be renewed?",
    "Which rule covers section 12?",
    "How many days for section 20?",
    "And how many renewals there?",
    "Is section 33 lent for longer than section 34?",
    "How many renewals does section 40 allow?",
    "Summarise the rule for section 5 in one sentence.",
    "What about section 6?",
    "And section 8?",
    "And section 9?",
]


def rules():
    lines = ["You are a careful assistant for a library. Rules:"]
    for i in range(1, 41):
        lines.append(f"{i}. Books in section {i} are lent for {7 + i % 5} days and renewed at most {i % 3 + 1} times.")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=40)
    a = ap.parse_args()
    c = openai.OpenAI(base_url=a.base + "/v1", api_key="sk", max_retries=0, timeout=600)
    system = rules()
    convo = [{"role": "system", "content": system}]
    turns, prev = [], None
    for i, q in enumerate(QUESTIONS[: a.turns]):
        last = i == a.turns - 1
        inp = [{"role": "developer", "content": system}, {"role": "user", "content": q}] if prev is None else q
        args = dict(model="m", input=inp, temperature=0, max_output_tokens=a.max_tokens)
        if prev is not None:
            args["previous_response_id"] = prev
        if last:
            text, r = "", None
            for ev in c.responses.create(stream=True, **args):
                if ev.type == "response.output_text.delta":
                    text += ev.delta
                if ev.type == "response.completed":
                    r = ev.response
            assert r is not None and r.output_text == text, "the stream's deltas are not its text"
        else:
            r = c.responses.create(**args)
        convo.append({"role": "user", "content": q})
        whole = c.chat.completions.create(model="m", messages=convo, temperature=0, max_tokens=a.max_tokens)
        chat = whole.choices[0].message.content
        convo.append({"role": "assistant", "content": chat})
        u = r.usage
        turns.append({"question": q, "answer": r.output_text, "chat": chat, "same": r.output_text == chat,
                      "input_tokens": u.input_tokens, "cached_tokens": u.input_tokens_details.cached_tokens,
                      "cached_share": round(u.input_tokens_details.cached_tokens / u.input_tokens, 3),
                      "streamed": last})
        prev = r.id
    print(json.dumps({"turns": turns,
                      "all_same": all(t["same"] for t in turns),
                      "least_cached_share_after_first": min((t["cached_share"] for t in turns[1:]), default=None)},
                     indent=1))


if __name__ == "__main__":
    main()
