"""What the experiment programs share: the ablation suites, the papers' claims and their
verdicts, and the provenance stamped beside every committed figure."""
