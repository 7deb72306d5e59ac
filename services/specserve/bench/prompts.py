"""The fixed prompt suite: chat Q&A, rewriting given text, editing given code."""

SUITE: dict[str, list[str]] = {
    "chat": [
        "What are three practical tips for staying focused while working from home? Answer briefly.",
        "Explain what a hash table is and why lookups are fast, in a short paragraph.",
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
    ],
    "code": [
        "Rename the variable `lst` to `numbers` in this Python function and return the full code:\n\n"
        "```python\ndef average(lst):\n    if not lst:\n        return 0.0\n    total = 0\n    for x in lst:\n"
        "        total += x\n    return total / len(lst)\n```",
        "Add type hints to this Python function and return the full code:\n\n"
        "```python\ndef merge_counts(a, b):\n    result = dict(a)\n    for key, value in b.items():\n"
        "        result[key] = result.get(key, 0) + value\n    return result\n```",
    ],
}
