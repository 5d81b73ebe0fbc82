"""The command-line programs: ``serve`` and ``generate`` (run on every rank under torchrun).

``launch/serve.py`` and ``launch/generate.py`` run these modules' ``main()``; ``rtp serve`` and
``rtp generate`` (:mod:`rtp.launcher`) start torchrun on them with ``-m``.
"""
