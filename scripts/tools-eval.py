#!/usr/bin/env python3
"""Tool calling through `kvchat serve`, measured with the official openai client (issue 63).

  target/pyenv/bin/python scripts/tools-eval.py MODEL [--kvchat target/release/kvchat]
      [--choice auto] [--threads 2]

(target/pyenv: scripts/test.sh makes it with openai; this script also needs `jsonschema`:
`target/pyenv/bin/pip install jsonschema`.)

Starts one server on 127.0.0.1 (--exit-after bounds it), sends REQUESTS — each a user question
that needs exactly one call of one offered function, with arguments — greedy, and reports: how
many answers made a call, how many made the call the question needs, and how many calls parse
as JSON and validate against the function's parameter schema (jsonschema). Every request offers
all the functions, so choosing the right one is part of the test.

Progress goes to stderr; stdout holds only the JSON report.
"""
import argparse
import json
import socket
import subprocess
import sys
import time

import jsonschema
import openai

S = lambda **props: {"type": "object", "properties": props, "required": list(props)}
STR = {"type": "string"}
NUM = {"type": "number"}
INT = {"type": "integer"}

FUNCTIONS = [
    ("get_weather", "Get the current weather in a city", S(city=STR)),
    ("convert_currency", "Convert an amount of money from one currency to another",
     S(amount=NUM, source=STR, target=STR)),
    ("send_email", "Send an email", S(to=STR, subject=STR, body=STR)),
    ("search_web", "Search the web for a query", S(query=STR)),
    ("get_stock_price", "Get the latest price of a stock by its ticker symbol", S(ticker=STR)),
    ("set_timer", "Set a timer for a number of minutes", S(minutes=INT)),
    ("translate", "Translate a text into a target language", S(text=STR, language=STR)),
    ("create_event", "Create a calendar event on a date (YYYY-MM-DD) with a title",
     S(title=STR, date=STR)),
    ("get_time", "Get the current local time in a time zone (IANA name)", S(timezone=STR)),
    ("calculate", "Evaluate an arithmetic expression", S(expression=STR)),
]

REQUESTS = [
    ("What is the weather in Paris right now?", "get_weather"),
    ("Is it raining in Tokyo today?", "get_weather"),
    ("How warm is it in Cairo at the moment?", "get_weather"),
    ("Convert 100 US dollars to euros.", "convert_currency"),
    ("How many Japanese yen is 250 British pounds?", "convert_currency"),
    ("Send an email to alice@example.com with the subject Lunch saying: see you at noon.",
     "send_email"),
    ("Email bob@example.com, subject Report, body: the report is attached.", "send_email"),
    ("Search the web for the latest Rust release notes.", "search_web"),
    ("Look up on the web who won the 2022 World Cup.", "search_web"),
    ("What is the current stock price of AAPL?", "get_stock_price"),
    ("Get me the latest share price of Microsoft (MSFT).", "get_stock_price"),
    ("Set a timer for 10 minutes.", "set_timer"),
    ("Start a 25 minute timer for my pomodoro.", "set_timer"),
    ("Translate 'good morning' into Spanish.", "translate"),
    ("Translate the sentence 'where is the station' into German.", "translate"),
    ("Create a calendar event titled Dentist on 2026-12-15.", "create_event"),
    ("Add an event called Team offsite to my calendar on 2027-01-20.", "create_event"),
    ("What time is it now in America/New_York?", "get_time"),
    ("Tell me the current time in the Europe/Berlin time zone.", "get_time"),
    ("Calculate 1234 * 5678.", "calculate"),
    ("What is (17 + 25) / 6? Use the calculator.", "calculate"),
    ("Check the weather in Buenos Aires for me.", "get_weather"),
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--kvchat", default="target/release/kvchat")
    ap.add_argument("--choice", default="auto")
    ap.add_argument("--threads", default="2")
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
    tools = [{"type": "function", "function": {"name": n, "description": d, "parameters": p}}
             for n, d, p in FUNCTIONS]
    schemas = {n: p for n, _, p in FUNCTIONS}
    rows, t0 = [], time.time()
    try:
        for question, want in REQUESTS:
            r = c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": question}], tools=tools,
                tool_choice=a.choice, temperature=0, max_tokens=120)
            ch = r.choices[0]
            calls = ch.message.tool_calls or []
            row = {"question": question, "want": want, "finish": ch.finish_reason,
                   "calls": [], "text": ch.message.content}
            for t in calls:
                entry = {"name": t.function.name, "arguments": t.function.arguments}
                try:
                    args = json.loads(t.function.arguments)
                    jsonschema.validate(args, schemas[t.function.name])
                    entry["valid"] = True
                except (ValueError, KeyError, jsonschema.ValidationError) as e:
                    entry["valid"] = False
                    entry["why"] = str(e).splitlines()[0]
                row["calls"].append(entry)
            rows.append(row)
            print(f"{want:>16}: {[(e['name'], e['valid']) for e in row['calls']]}", file=sys.stderr)
    finally:
        server.kill()
    n = len(rows)
    called = sum(1 for r in rows if r["calls"])
    right = sum(1 for r in rows if r["calls"] and r["calls"][0]["name"] == r["want"])
    made = [e for r in rows for e in r["calls"]]
    valid = sum(1 for e in made if e["valid"])
    print(json.dumps({
        "model": a.model, "tool_choice": a.choice, "requests": n,
        "called": called, "called_share": round(called / n, 3),
        "right_function": right, "calls_made": len(made), "calls_valid": valid,
        "valid_share": round(valid / max(len(made), 1), 3),
        "seconds": round(time.time() - t0, 1), "rows": rows,
    }, indent=1))


if __name__ == "__main__":
    main()
