"""`python -m kvindex` is the `kvindex` command."""

from kvindex.cli.main import main

raise SystemExit(main())
