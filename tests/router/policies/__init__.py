"""Tests of router/policies/."""
