"""Runs in series, to answer a question: the sweep (the study's matrix), the knee
(goodput search), the advisor and its placement search, sizing, the offline simulation,
profiling an engine, the demo."""
