from gym_rpc.cli import main

main()
