"""Thin Typer commands; heavy imports happen inside the commands."""
