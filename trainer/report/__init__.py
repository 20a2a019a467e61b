"""What a run shows a person: its summary figures and its charts."""
