"""Small Python functions: training tasks for coding answers and bare-signature bodies, and the
held-out bare signatures the evaluation completes (names that no training task or training
stdlib module defines).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class CodeTask:
    """``what`` completes "a function that ..."; the function is ``def name(args):`` + body."""

    what: str
    name: str
    args: str
    body: tuple[str, ...]

    def source(self) -> str:
        return "\n".join([f"def {self.name}({self.args}):", *("    " + line for line in self.body)]) + "\n"


def _t(what: str, name: str, args: str, *body: str) -> CodeTask:
    return CodeTask(what, name, args, body)


CODE_TASKS = [
    _t("returns the sum of a list of numbers", "total", "values", "result = 0", "for v in values:", "    result += v", "return result"),
    _t("returns the largest item of a list", "largest", "items", "best = items[0]", "for x in items[1:]:", "    if x > best:", "        best = x", "return best"),
    _t("returns the smallest item of a list", "smallest", "items", "return min(items)"),
    _t("reverses a string", "reverse", "text", "return text[::-1]"),
    _t("counts the vowels in a string", "count_vowels", "text", "return sum(1 for c in text.lower() if c in 'aeiou')"),
    _t("checks whether a number is prime", "is_prime", "n", "if n < 2:", "    return False", "i = 2", "while i * i <= n:", "    if n % i == 0:", "        return False", "    i += 1", "return True"),
    _t("returns the n-th Fibonacci number", "fibonacci", "n", "a, b = 0, 1", "for _ in range(n):", "    a, b = b, a + b", "return a"),
    _t("computes the factorial of n", "factorial", "n", "result = 1", "for i in range(2, n + 1):", "    result *= i", "return result"),
    _t("removes duplicates from a list, keeping order", "unique", "items", "seen = set()", "out = []", "for x in items:", "    if x not in seen:", "        seen.add(x)", "        out.append(x)", "return out"),
    _t("checks whether a string is a palindrome", "is_palindrome", "text", "s = text.lower()", "return s == s[::-1]"),
    _t("counts the words in a string", "word_count", "text", "return len(text.split())"),
    _t("returns the average of a list of numbers", "mean", "values", "if not values:", "    raise ValueError('mean of empty list')", "return sum(values) / len(values)"),
    _t("flattens a list of lists", "flatten", "lists", "return [x for sub in lists for x in sub]"),
    _t("returns the even numbers of a list", "evens", "numbers", "return [n for n in numbers if n % 2 == 0]"),
    _t("returns the odd numbers of a list", "odds", "numbers", "return [n for n in numbers if n % 2 == 1]"),
    _t("squares every number in a list", "squares", "numbers", "return [n * n for n in numbers]"),
    _t("sorts a list of words by length", "sort_by_length", "words", "return sorted(words, key=len)"),
    _t("returns the last element of a list", "last", "items", "if not items:", "    return None", "return items[-1]"),
    _t("returns the first n items of a list", "take", "items, n", "return items[:n]"),
    _t("joins a list of strings with commas", "join_commas", "parts", "return ', '.join(parts)"),
    _t("capitalizes every word of a sentence", "title_case", "sentence", "return ' '.join(w.capitalize() for w in sentence.split())"),
    _t("counts how often each item appears in a list", "frequencies", "items", "counts = {}", "for x in items:", "    counts[x] = counts.get(x, 0) + 1", "return counts"),
    _t("returns the greatest common divisor of two numbers", "gcd", "a, b", "while b:", "    a, b = b, a % b", "return a"),
    _t("checks whether a year is a leap year", "is_leap_year", "year", "return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)"),
    _t("converts a temperature from Celsius to Kelvin", "to_kelvin", "celsius", "return celsius + 273.15"),
    _t("returns the digits of a number as a list", "digits", "n", "return [int(d) for d in str(abs(n))]"),
    _t("sums the digits of a number", "digit_sum", "n", "return sum(int(d) for d in str(abs(n)))"),
    _t("merges two dictionaries", "merge", "a, b", "out = dict(a)", "out.update(b)", "return out"),
    _t("swaps the keys and values of a dictionary", "invert", "mapping", "return {v: k for k, v in mapping.items()}"),
    _t("splits a list into chunks of size n", "chunked", "items, n", "return [items[i:i + n] for i in range(0, len(items), n)]"),
    _t("returns the longest word of a sentence", "longest_word", "sentence", "words = sentence.split()", "if not words:", "    return ''", "return max(words, key=len)"),
    _t("removes the whitespace around every string of a list", "strip_all", "lines", "return [line.strip() for line in lines]"),
    _t("checks whether all items of a list are positive", "all_positive", "numbers", "return all(n > 0 for n in numbers)"),
    _t("returns the product of a list of numbers", "product", "numbers", "result = 1", "for n in numbers:", "    result *= n", "return result"),
    _t("returns the index of an item in a list, or -1", "find_index", "items, target", "for i, x in enumerate(items):", "    if x == target:", "        return i", "return -1"),
    _t("counts the lines of a text file", "count_lines", "path", "with open(path) as f:", "    return sum(1 for _ in f)"),
    _t("reads a text file and returns its words", "read_words", "path", "with open(path) as f:", "    return f.read().split()"),
    _t("returns the n largest numbers of a list", "top_n", "numbers, n", "return sorted(numbers, reverse=True)[:n]"),
    _t("returns the distance between two points", "distance", "p, q", "dx = p[0] - q[0]", "dy = p[1] - q[1]", "return (dx * dx + dy * dy) ** 0.5"),
    _t("checks whether two strings are anagrams", "is_anagram", "a, b", "return sorted(a.lower()) == sorted(b.lower())"),
    _t("returns the running totals of a list", "running_total", "values", "out = []", "acc = 0", "for v in values:", "    acc += v", "    out.append(acc)", "return out"),
    _t("removes every None from a list", "drop_none", "items", "return [x for x in items if x is not None]"),
    _t("pairs up two lists into a dictionary", "to_dict", "keys, values", "return dict(zip(keys, values))"),
    _t("returns a string repeated n times with spaces", "repeat", "word, n", "return ' '.join([word] * n)"),
    _t("rotates a list left by k places", "rotate", "items, k", "if not items:", "    return items", "k %= len(items)", "return items[k:] + items[:k]"),
    _t("returns the median of a list of numbers", "median", "values", "s = sorted(values)", "mid = len(s) // 2", "if len(s) % 2:", "    return s[mid]", "return (s[mid - 1] + s[mid]) / 2"),
    _t("returns True if a list is sorted", "is_sorted", "items", "return all(a <= b for a, b in zip(items, items[1:]))"),
    _t("converts a list of numbers to strings", "as_strings", "numbers", "return [str(n) for n in numbers]"),
    _t("returns the characters of a string that are digits", "only_digits", "text", "return ''.join(c for c in text if c.isdigit())"),
    _t("counts the uppercase letters of a string", "count_upper", "text", "return sum(1 for c in text if c.isupper())"),
]

# Held-out bare signatures (no docstring), written as an editor would send them; no training task
# or training stdlib module defines these names (tests check).
HELDOUT_SIGNATURES = [
    "def clamp(x, lo, hi):",
    "def celsius_to_fahrenheit(c):",
    "def safe_divide(a, b):",
    "def count_char(text, ch):",
    "def second_largest(numbers):",
    "def remove_vowels(s):",
    "def sum_of_squares(nums):",
    "def is_even(n):",
    "def average_length(words):",
    "def first_word(sentence):",
    "def cube(x):",
    "def max_of_three(a, b, c):",
    "def contains_digit(s):",
    "def prefix_lines(lines, prefix):",
    "def list_difference(a, b):",
    "def nth_power(base, n):",
    "def triangle_area(base, height):",
    "def reverse_words(sentence):",
    "def count_positive(values):",
    "def minutes_to_hours(minutes):",
    "def square_root(x):",
    "def make_greeting(name):",
    "def dedupe_sorted(items):",
    "def shout(message):",
    "def sum_range(start, stop):",
    "def has_duplicates(items):",
    "def word_lengths(words):",
    "def percent(part, whole):",
    "def middle_item(items):",
    "def count_spaces(text):",
    "def double_all(numbers):",
    "def pluralize(word, count):",
    "def circle_area(radius):",
    "def keys_with_value(mapping, value):",
    "def alternate_items(a, b):",
    "def is_vowel(ch):",
    "def pad_left(text, width):",
    "def sum_even(numbers):",
    "def miles_to_km(miles):",
    "def all_equal(items):",
]


TASK_COPIES = 10  # each task's function appears this often among the training snippets


def code_snippets(rng: random.Random) -> list[str]:
    """The tasks' functions as plain source, TASK_COPIES times each, in shuffled order."""
    out = [t.source() for t in CODE_TASKS for _ in range(TASK_COPIES)]
    rng.shuffle(out)
    return out
