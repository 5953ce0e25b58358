module gym_rpc/interop/go

go 1.19

require (
	google.golang.org/grpc v1.33.3
	google.golang.org/protobuf v1.28.1
	gym_rpc/stubs/go v1.2.0
)

// The stubs module is made by `make stubs` in the repository's stubs/go; it is not published anywhere.
replace gym_rpc/stubs/go => ../../stubs/go
