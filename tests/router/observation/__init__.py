"""Tests of router/observation/."""
