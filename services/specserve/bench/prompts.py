"""The fixed prompt suite: chat Q&A, rewriting given text, editing given code.

Six prompts per workload, none of them a prompt `specserve distill` trains on. The first two of each
are the suite every figure before `--prompts 6` was measured on (`specserve bench` still runs two by default);
the other four were written afterwards, before any draft was measured on them, so that a workload's figure
does not hang on two answers.
"""

SUITE: dict[str, list[str]] = {
    "chat": [
        "What are three practical tips for staying focused while working from home? Answer briefly.",
        "Explain what a hash table is and why lookups are fast, in a short paragraph.",
        "I have a job interview tomorrow for a junior accountant position. How should I prepare tonight?",
        "Why do we have leap years? Keep the answer short.",
        "Suggest a simple weekly exercise plan for a beginner who has 30 minutes a day.",
        "What is the difference between weather and climate?",
    ],
    "rewrite": [
        "Rewrite the following paragraph in formal English, keeping all facts:\n\n"
        "hey team, so the quarterly numbers came in and they're honestly not great. sales dropped like 12 "
        "percent in the north region, mostly cuz two big clients left. the south region did ok tho, up 3 "
        "percent. we gotta talk about this at the meeting on thursday, so pls bring your ideas.",
        "Fix the spelling and grammar mistakes in this text and return the corrected text:\n\n"
        "The comittee have decided that the new libary will be open on weekdays from nine to five. "
        "Visitors must to register at the front desk and shows a valid ID. Food and drinks is not allowed "
        "inside the reading rooms, but their is a small cafe on the ground floor.",
        "Make this email more polite and professional:\n\n"
        "Send me the report by friday. I already asked twice and I still dont have it. This is holding up the "
        "whole project.",
        "Shorten this paragraph to two sentences without losing the main points:\n\n"
        "Our town library will close for renovations from March 1 to May 15. During this time, books can be "
        "returned at the community center on Elm Street, which is open every day from 9 am to 6 pm. The online "
        "catalog and e-book lending will keep working as usual. We expect the renovated library to have a larger "
        "children's area, a quiet study room and new computers.",
        "Turn these meeting notes into a short paragraph of full sentences:\n\n"
        "- meeting moved to 3pm\n- Anna presents the budget\n- we need volunteers for the spring fair\n"
        "- Tom brings snacks",
        "Rewrite this product description so that it sounds more exciting, in under 60 words:\n\n"
        "This water bottle holds 750 ml. It is made of steel. It keeps drinks cold for 12 hours. It comes in "
        "three colors.",
    ],
    "code": [
        "Rename the variable `lst` to `numbers` in this Python function and return the full code:\n\n"
        "```python\ndef average(lst):\n    if not lst:\n        return 0.0\n    total = 0\n    for x in lst:\n"
        "        total += x\n    return total / len(lst)\n```",
        "Add type hints to this Python function and return the full code:\n\n"
        "```python\ndef merge_counts(a, b):\n    result = dict(a)\n    for key, value in b.items():\n"
        "        result[key] = result.get(key, 0) + value\n    return result\n```",
        "Rewrite this function with a list comprehension and return the full code:\n\n"
        "```python\ndef squares_of_evens(values):\n    result = []\n    for v in values:\n"
        "        if v % 2 == 0:\n            result.append(v * v)\n    return result\n```",
        "Make this Python function raise ValueError when `n` is negative and return the full code:\n\n"
        "```python\ndef factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n"
        "    return result\n```",
        "Write a Python function `is_palindrome(s)` that ignores case and spaces, and show two example calls.",
        "Fix the bug in this Python function and return the corrected code:\n\n"
        "```python\ndef last_item(items):\n    if len(items) == 0:\n        return None\n"
        "    return items[len(items)]\n```",
    ],
}

PER_WORKLOAD = min(len(prompts) for prompts in SUITE.values())
