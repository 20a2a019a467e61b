"""Training backends behind one interface (torch embedded, verl on Ray) and the checkpoints they all write."""
