"""Agent-like traces for suffix decoding: related requests sent one after another, whose answers
repeat each other more than they repeat their own prompt.

`write` makes seven prompt files under benchmarks/data/agentic/ (40 requests each, from templates
and word lists written here, a fixed seed): `sql` (SQLite queries over one schema), `extract`
(the same JSON fields from similar messages), `report` (a status template filled per project),
`tools` (one JSON tool call against a fixed tool list), `sql-shots` and `tools-shots` (the same
tasks sent as agent frameworks send them: the format shown in example turns before the question,
which is what makes a small model answer in it, so that answers share their structure as a
capable model's do; without them the default model ignores the format and rambles), and
`samples` (one word problem, answered SAMPLES times at temperature 0.8: best-of-n, where later
samples draft from earlier ones).
`record` decodes them with the default model (plain decoding, in order; greedy but for
`samples`) and keeps the token ids of each prompt and answer in `<trace>.recorded.jsonl`, which
`suffix_replay.py` replays without a model.

    python benchmarks/agentic_traces.py write
    python benchmarks/agentic_traces.py record --max-new-tokens 128 --threads 1 --batch 40
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "agentic"
TRACES = ("sql", "extract", "report", "tools", "sql-shots", "tools-shots", "samples")
PER_TRACE = 40
SAMPLES = 8  # the `samples` trace: best-of-n samples of one prompt

CITIES = ["Lisbon", "Oslo", "Denver", "Osaka", "Nairobi", "Lyon", "Austin", "Krakow", "Perth", "Porto",
          "Quebec", "Seville", "Tallinn", "Zurich", "Boston", "Dublin", "Ghent", "Hanoi", "Leeds", "Turin"]
NAMES = ["Ana Souza", "Bjorn Dahl", "Chen Wei", "Dara Okafor", "Elena Rossi", "Farid Haddad", "Grace Lee",
         "Hugo Martin", "Ines Navarro", "Jonas Berg", "Kira Ivanova", "Liam Walsh", "Maya Patel",
         "Noah Fischer", "Olga Novak", "Pablo Ruiz", "Quinn Harper", "Rosa Lima", "Sven Larsen", "Tara Singh"]
COMPANIES = ["Northwind Foods", "Bluepeak Analytics", "Cedar Logistics", "Helios Solar", "Ironleaf Games",
             "Juniper Health", "Kestrel Robotics", "Lumen Print", "Maple Freight", "Nimbus Cloud"]
ROLES = ["purchasing manager", "data engineer", "head of operations", "product owner", "office manager",
         "sales director", "IT administrator", "finance lead"]
CATEGORIES = ["books", "garden", "kitchen", "toys", "electronics", "sports"]
STATUSES = ["shipped", "pending", "cancelled", "delivered"]

SQL_SYSTEM = """You write SQLite queries for this database. Answer with one SQL query in a ```sql block and nothing else.

CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, email TEXT, city TEXT, signup_date DATE);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT, category TEXT, price REAL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers(id), order_date DATE, status TEXT);
CREATE TABLE order_items (order_id INTEGER REFERENCES orders(id), product_id INTEGER REFERENCES products(id), quantity INTEGER);"""

SQL_QUESTIONS = [
    "List the names and emails of all customers in {city}.",
    "How many orders did customers from {city} place in {year}?",
    "Show the total revenue per product category for orders placed in {year}.",
    "Which {n} products sold the most units overall? Show name and units sold.",
    "List the customers who have never placed an order.",
    "Show the number of orders with status '{status}' for each month of {year}.",
    "Which customers in {city} spent more than {amount} dollars in total?",
    "Show the average price of products in the '{category}' category.",
    "List the orders placed after {year}-0{month}-01 with status '{status}', newest first.",
    "For each city, show how many customers signed up in {year}.",
    "Show the {n} customers with the highest total spending and their totals.",
    "Which products in the '{category}' category have never been ordered?",
]

EXTRACT_TASK = ("Extract these fields from the message as one JSON object with the keys name, company, "
                "role, email, phone, city and request. Use null for a field the message does not give. "
                "Answer with the JSON only.\n\nMessage:\n")
EXTRACT_MESSAGES = [
    "Hi, this is {name}, {role} at {company} in {city}. Could you {request}? You can reach me at {email} or {phone}.",
    "Hello team,\n{request_cap}, please. I work as {role} for {company}.\nBest regards,\n{name}\n{email}",
    "From: {name} <{email}>\nCompany: {company}, {city}\n\nWe would like you to {request}. Call {phone} if anything is unclear.",
    "Good morning! {name} here ({company}). As the {role} I need you to {request}. Thanks!",
]
REQUESTS = ["send a quote for 40 office chairs", "move our delivery to next Tuesday", "renew the annual support contract",
            "add two users to our account", "cancel invoice 4471", "schedule a demo for the new dashboard",
            "ship the spare parts to our second site", "explain the price change on the last bill"]

REPORT_TASK = ("Write this project's weekly status with exactly this template, one field a line:\n"
               "Project: <name>\nOwner: <owner>\nStatus: <On track | At risk | Blocked>\nProgress: <percent>%\n"
               "Risks: <one sentence>\nNext step: <one sentence>\n\nData: ")
REPORT_DATA = ("project {project}; owner {name}; {done} of {total} tasks done; deadline in {weeks} weeks; "
               "{blocker}.")
PROJECTS = ["billing migration", "mobile app v2", "warehouse scanners", "data lake cleanup", "customer portal",
            "payroll upgrade", "search relevance", "office move", "security audit", "API rate limits"]
BLOCKERS = ["no blockers", "waiting for the vendor's contract", "two engineers on leave", "test servers are down",
            "budget approval pending", "no blockers but scope grew by three tasks"]

TOOLS_SYSTEM = """You are an assistant that acts by calling tools. Available tools:
- get_weather(city: string, date: string YYYY-MM-DD)
- search_flights(origin: string, destination: string, date: string YYYY-MM-DD, passengers: integer)
- book_hotel(city: string, check_in: string YYYY-MM-DD, nights: integer, guests: integer)
- send_email(to: string, subject: string, body: string)
- create_calendar_event(title: string, date: string YYYY-MM-DD, time: string HH:MM, duration_minutes: integer)
Reply with exactly one tool call as JSON: {"tool": "<name>", "arguments": {...}}."""
TOOL_REQUESTS = [
    "What will the weather be like in {city} on 2025-0{month}-{day}?",
    "Find flights from {city} to {city2} on 2025-0{month}-{day} for {n} people.",
    "Book a hotel in {city} from 2025-0{month}-{day} for {nights} nights, {n} guests.",
    "Email {email} that the meeting about the {project} moves to Friday.",
    "Put a {duration}-minute meeting called '{project} review' in my calendar on 2025-0{month}-{day} at {hour}:00.",
]

#: example turns before the question (few-shot prompting, as text-to-SQL and tool-calling
#: frameworks send the answer format): canonical answers, none of them a trace's answer
SQL_SHOTS = [
    ("List the names of all customers in Oslo.", "```sql\nSELECT name FROM customers WHERE city = 'Oslo';\n```"),
    ("How many orders were placed in 2023?",
     "```sql\nSELECT COUNT(*) FROM orders WHERE strftime('%Y', order_date) = '2023';\n```"),
    ("Show the total quantity sold per product name.",
     "```sql\nSELECT p.name, SUM(oi.quantity) AS units\nFROM order_items oi\nJOIN products p ON p.id = oi.product_id\n"
     "GROUP BY p.name;\n```"),
]
TOOLS_SHOTS = [
    ("What will the weather be like in Oslo on 2025-04-12?",
     '{"tool": "get_weather", "arguments": {"city": "Oslo", "date": "2025-04-12"}}'),
    ("Book a hotel in Lyon from 2025-06-03 for 2 nights, 1 guests.",
     '{"tool": "book_hotel", "arguments": {"city": "Lyon", "check_in": "2025-06-03", "nights": 2, "guests": 1}}'),
    ("Email grace.lee@example.com that the meeting about the office move moves to Monday.",
     '{"tool": "send_email", "arguments": {"to": "grace.lee@example.com", "subject": "office move meeting", '
     '"body": "The meeting about the office move moves to Monday."}}'),
]


def _shots(examples) -> list[dict]:
    return [m for q, a in examples for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})]


SAMPLES_PROMPT = ("A shop sells pens at 3 dollars each and notebooks at 5 dollars each. Mia buys 4 pens and "
                  "some notebooks and pays 32 dollars. How many notebooks did she buy? Think step by step, then "
                  "give the answer on its own line as 'Answer: <number>'.")


def _fill(rng: random.Random, template: str) -> str:
    name = rng.choice(NAMES)
    city, city2 = rng.sample(CITIES, 2)
    request = rng.choice(REQUESTS)
    return template.format(
        city=city, city2=city2, year=rng.choice([2022, 2023, 2024]), n=rng.randint(2, 6), status=rng.choice(STATUSES),
        amount=rng.choice([500, 1000, 2500]), category=rng.choice(CATEGORIES), month=rng.randint(1, 9),
        name=name, role=rng.choice(ROLES), company=rng.choice(COMPANIES), request=request,
        request_cap=request[0].upper() + request[1:], email=name.lower().replace(" ", ".") + "@example.com",
        phone=f"+1 555 {rng.randint(100, 999)} {rng.randint(1000, 9999)}", day=rng.randint(10, 28),
        nights=rng.randint(1, 5), project=rng.choice(PROJECTS), duration=rng.choice([30, 45, 60]),
        hour=rng.randint(9, 16))


def make_trace(trace: str, count: int = PER_TRACE, seed: int = 0) -> list[dict]:
    """The requests of one trace, as --prompts-file rows (OpenAI-style messages)."""
    rng = random.Random(f"{trace}:{seed}")
    rows = []
    for i in range(count):
        if trace in ("sql", "sql-shots"):
            q = _fill(rng, SQL_QUESTIONS[i % len(SQL_QUESTIONS)])
            shots = _shots(SQL_SHOTS) if trace == "sql-shots" else []
            messages = [{"role": "system", "content": SQL_SYSTEM}, *shots, {"role": "user", "content": q}]
        elif trace == "extract":
            msg = _fill(rng, EXTRACT_MESSAGES[i % len(EXTRACT_MESSAGES)])
            messages = [{"role": "user", "content": EXTRACT_TASK + msg}]
        elif trace == "report":
            total = rng.randint(8, 30)
            data = REPORT_DATA.format(project=rng.choice(PROJECTS), name=rng.choice(NAMES), total=total,
                                      done=rng.randint(0, total), weeks=rng.randint(1, 8), blocker=rng.choice(BLOCKERS))
            messages = [{"role": "user", "content": REPORT_TASK + data}]
        elif trace in ("tools", "tools-shots"):
            shots = _shots(TOOLS_SHOTS) if trace == "tools-shots" else []
            messages = [{"role": "system", "content": TOOLS_SYSTEM}, *shots,
                        {"role": "user", "content": _fill(rng, TOOL_REQUESTS[i % len(TOOL_REQUESTS)])}]
        elif trace == "samples":
            messages = [{"role": "user", "content": SAMPLES_PROMPT}]
        else:
            raise ValueError(f"unknown trace {trace!r}; known: {', '.join(TRACES)}")
        rows.append({"messages": messages})
    return rows[:1] if trace == "samples" else rows


def write(traces) -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    for trace in traces:
        path = DATA / f"{trace}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in make_trace(trace)))
        print(f"wrote {path} ({len(make_trace(trace))} requests)")


def record(traces, max_new_tokens: int, threads: int | None, batch: int) -> None:
    """The default model's answers, in order, with each prompt's and answer's token ids: greedy for
    the agent traces; for `samples`, SAMPLES samples of one prompt at temperature 0.8, seeds 0..7.
    Plain decoding, batched (the row-stable kernels give each row the tokens it gets alone)."""
    import dataclasses

    from specdec.api import load
    from specdec.text import encode_prompt

    spec = load(method="none", threads=threads)
    for trace in traces:
        rows = [json.loads(line) for line in (DATA / f"{trace}.jsonl").read_text().splitlines() if line.strip()]
        prompts = [encode_prompt(spec.tokenizer, r["messages"], None) for r in rows]
        base = dataclasses.replace(spec.config.sampling, max_new_tokens=max_new_tokens, temperature=0.0)
        jobs = [(p, base) for p in prompts]
        if trace == "samples":
            jobs = [(prompts[0], dataclasses.replace(base, temperature=0.8, seed=s)) for s in range(SAMPLES)]
        out = []
        for start in range(0, len(jobs), batch):
            chunk = jobs[start:start + batch]
            if trace == "samples":  # one seed a call: a batch shares its sampling settings
                results = [spec.engine.generate([p], params)[0] for p, params in chunk]
            else:
                results = spec.engine.generate([p for p, _ in chunk], base)
            for (p, params), res in zip(chunk, results):
                out.append({"prompt_ids": p, "output_ids": list(res.tokens), "temperature": params.temperature,
                            "seed": params.seed})
            print(f"{trace}: {len(out)}/{len(jobs)}", file=sys.stderr, flush=True)
        path = DATA / f"{trace}.recorded.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in out))
        print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["write", "record"])
    ap.add_argument("--traces", default=",".join(TRACES), help=f"comma-separated. Default: {','.join(TRACES)}")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batch", type=int, default=8, help="rows decoded together while recording. Default: 8")
    args = ap.parse_args()
    traces = [t for t in args.traces.split(",") if t]
    if args.command == "write":
        write(traces)
    else:
        record(traces, args.max_new_tokens, args.threads, args.batch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
