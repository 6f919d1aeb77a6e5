"""Tests of router/http/."""
