#!/usr/bin/env python3
"""Structured output through `kvchat serve`, measured with the official openai client (issue 63).

  target/pyenv/bin/python scripts/schema-eval.py MODEL [--kvchat target/release/kvchat]
      [--threads 2] [--unconstrained]

(target/pyenv: scripts/test.sh makes it with openai; this script also needs `jsonschema`:
`target/pyenv/bin/pip install jsonschema`.)

Starts one server on 127.0.0.1 (--exit-after bounds it) and sends CASES — a request and a JSON
schema each: nested objects, arrays with bounds, enums, bounded numbers, required and optional
fields, `$ref`/`$defs`, anyOf, const, patterns — greedy, with `response_format` json_schema
(strict), the schema also shown in the prompt as a user would. Each answer is parsed and
validated (jsonschema). `--unconstrained` sends the same prompts without `response_format`, to
show what the grammar buys. Progress goes to stderr; stdout holds only the JSON report.
"""
import argparse
import json
import socket
import subprocess
import sys
import time

import jsonschema
import openai


def obj(required=None, **props):
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required,
            "additionalProperties": False}


STR, INT, NUM, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}

CASES = [
    ("A person named Ada Lovelace, born 1815.", obj(name=STR, born=INT)),
    ("The book 'Dune' by Frank Herbert, with its year and whether it is fiction.",
     obj(title=STR, author=STR, year=INT, fiction=BOOL)),
    ("Three primary colours.", {"type": "array", "items": STR, "minItems": 3, "maxItems": 3}),
    ("Classify the sentiment of: 'I love this phone, the battery lasts forever.'",
     obj(sentiment={"enum": ["positive", "negative", "neutral"]},
         confidence={"type": "number", "minimum": 0, "maximum": 1})),
    ("A product: a blue cotton t-shirt costing 19.99 euros, sizes S, M and L.",
     obj(name=STR, price={"type": "number", "exclusiveMinimum": 0},
         currency={"enum": ["EUR", "USD", "GBP"]},
         sizes={"type": "array", "items": {"enum": ["XS", "S", "M", "L", "XL"]},
                "minItems": 1, "maxItems": 5})),
    ("An address: 10 Downing Street, London, SW1A 2AA, United Kingdom.",
     obj(street=STR, city=STR, postcode=STR, country=STR)),
    ("A user profile for alice, aged 30, with an optional nickname.",
     obj(["username", "age"], username=STR, age={"type": "integer", "minimum": 0, "maximum": 150},
         nickname=STR)),
    ("A company with its CEO as a nested person object: Acme Corp, CEO Jane Doe aged 52.",
     obj(company=STR, ceo=obj(name=STR, age=INT))),
    ("A recipe for pancakes with two ingredients and their quantities in grams.",
     obj(dish=STR, ingredients={"type": "array", "minItems": 2, "maxItems": 6,
                                "items": obj(item=STR, grams={"type": "integer", "minimum": 1, "maximum": 2000})})),
    ("The weather in Paris: 18 degrees celsius and sunny.",
     obj(city=STR, temperature={"type": "number", "minimum": -90, "maximum": 60},
         unit={"const": "celsius"}, sky={"enum": ["sunny", "cloudy", "rainy", "snowy"]})),
    ("A to-do list with two tasks, each with a title and done flag.",
     {"$defs": {"task": obj(title=STR, done=BOOL)},
      "type": "object", "properties": {"tasks": {"type": "array", "items": {"$ref": "#/$defs/task"},
                                                 "minItems": 1, "maxItems": 5}},
      "required": ["tasks"], "additionalProperties": False}),
    ("An HTTP response: status 404 with the message Not Found.",
     obj(status={"type": "integer", "minimum": 100, "maximum": 599}, message=STR)),
    ("A date: the first of March 2024, as year, month and day.",
     obj(year={"type": "integer", "minimum": 1900, "maximum": 2100},
         month={"type": "integer", "minimum": 1, "maximum": 12},
         day={"type": "integer", "minimum": 1, "maximum": 31})),
    ("A shape: a circle of radius 2.5.",
     {"anyOf": [obj(kind={"const": "circle"}, radius={"type": "number", "minimum": 0}),
                obj(kind={"const": "square"}, side={"type": "number", "minimum": 0})]}),
    ("A movie rating of Inception out of 5 stars, with a one-sentence review.",
     obj(movie=STR, stars={"type": "integer", "minimum": 1, "maximum": 5}, review=STR)),
    ("A file tree: a folder src holding the files main.rs and lib.rs.",
     {"$defs": {"node": {"type": "object", "additionalProperties": False, "required": ["name"],
                         "properties": {"name": STR, "children": {"type": "array", "maxItems": 4,
                                                                  "items": {"$ref": "#/$defs/node"}}}}},
      "$ref": "#/$defs/node"}),
    ("An email address for Bob at example.com.",
     obj(email={"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]+$"})),
    ("A point in 3D: x 1, y 2, z 3.", obj(x=NUM, y=NUM, z=NUM)),
    ("An invoice: number INV-001 with two line items and a total.",
     obj(number={"type": "string", "pattern": "^INV-[0-9]{3}$"},
         items={"type": "array", "minItems": 1, "maxItems": 4,
                "items": obj(description=STR, amount={"type": "number", "minimum": 0})},
         total={"type": "number", "minimum": 0})),
    ("A log entry: level error, the message 'disk full', on host db1.",
     obj(level={"enum": ["debug", "info", "warning", "error"]}, message=STR, host=STR)),
    ("A country with its capital and a list of up to three official languages: Switzerland.",
     obj(country=STR, capital=STR,
         languages={"type": "array", "items": STR, "minItems": 1, "maxItems": 3})),
    ("A yes or no answer: is water wet? With a short reason.", obj(answer=BOOL, reason=STR)),
    ("A meeting with optional notes: standup at 09:30 for 15 minutes.",
     obj(["title", "time", "minutes"], title=STR,
         time={"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
         minutes={"type": "integer", "minimum": 5, "maximum": 480}, notes=STR)),
    ("A translation of 'thank you' into French and German.",
     obj(source=STR, translations=obj(french=STR, german=STR))),
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--kvchat", default="target/release/kvchat")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--unconstrained", action="store_true")
    a = ap.parse_args()
    port = free_port()
    server = subprocess.Popen(
        [a.kvchat, "serve", "-m", a.model, "--port", str(port), "--threads", a.threads,
         "--ctx", "4096", "--exit-after", "1800", "--no-kv-store"],
        stderr=subprocess.PIPE, text=True)
    line = server.stderr.readline()
    if " at http://" not in line:
        sys.exit(f"the server did not start: {line}")
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk", max_retries=0,
                      timeout=600)
    rows, t0 = [], time.time()
    try:
        for i, (ask, schema) in enumerate(CASES):
            prompt = f"{ask}\nAnswer with JSON only, matching this JSON schema:\n{json.dumps(schema)}"
            extra = {} if a.unconstrained else {"response_format": {
                "type": "json_schema",
                "json_schema": {"name": f"case{i}", "schema": schema, "strict": True}}}
            try:
                r = c.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": prompt}], temperature=0,
                    max_tokens=400, **extra)
            except openai.BadRequestError as e:
                # A schema the server cannot honour is refused, never answered unconstrained.
                rows.append({"case": i, "valid": False, "refused": str(e)})
                print(f"case {i:2}: REFUSED {e}", file=sys.stderr)
                continue
            text = r.choices[0].message.content or ""
            row = {"case": i, "finish": r.choices[0].finish_reason, "answer": text}
            try:
                jsonschema.validate(json.loads(text), schema)
                row["valid"] = True
            except (ValueError, jsonschema.ValidationError) as e:
                row["valid"] = False
                row["why"] = str(e).splitlines()[0]
            rows.append(row)
            print(f"case {i:2}: {'valid' if row['valid'] else 'INVALID'} {text[:70]!r}",
                  file=sys.stderr)
    finally:
        server.kill()
    valid = sum(r["valid"] for r in rows)
    print(json.dumps({
        "model": a.model, "constrained": not a.unconstrained, "cases": len(rows),
        "valid": valid, "valid_share": round(valid / len(rows), 3),
        "seconds": round(time.time() - t0, 1), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
