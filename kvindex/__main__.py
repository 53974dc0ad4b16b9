"""`python -m kvindex` is the `kvindex` command."""

from kvindex.api.cli import main

raise SystemExit(main())
