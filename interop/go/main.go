// Command client calls a gym_rpc head from Go with the stubs `make stubs` generates (the Go module
// gym_rpc/stubs/go); it prints one JSON line per answer, in the protobuf JSON mapping.
//
// Run: cd interop/go && go run . 127.0.0.1:11000
// It ends after the watch's snapshot; -changes N waits for N changes too (stop or start a server to cause one).
// A head with a token and TLS: GYM_RPC_TOKEN=... go run . -ca ca.pem 127.0.0.1:11000
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	gymrpcv1 "gym_rpc/stubs/go/gym_rpc/v1"
)

func main() {
	caFile := flag.String("ca", "", "PEM file of the CA that signed the head's certificate (TLS); plaintext without it")
	changes := flag.Int("changes", 0, "changes to wait for after the watch's snapshot (stop or start a server to cause one)")
	flag.Parse()
	if flag.NArg() != 1 {
		fmt.Fprintln(os.Stderr, "usage: client [-ca CA_FILE] [-changes N] HOST:PORT   (the token, if any, from GYM_RPC_TOKEN)")
		os.Exit(2)
	}
	if err := run(flag.Arg(0), *caFile, os.Getenv("GYM_RPC_TOKEN"), *changes); err != nil {
		fmt.Fprintln(os.Stderr, "client:", err)
		os.Exit(1)
	}
}

func run(address, caFile, token string, changes int) error {
	// Every call shares one deadline: the program always ends by itself.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
	}
	transport, err := transportOption(caFile)
	if err != nil {
		return err
	}
	conn, err := grpc.DialContext(ctx, address, transport)
	if err != nil {
		return err
	}
	defer conn.Close()
	head := gymrpcv1.NewControlPlaneServiceClient(conn)

	config, err := head.GetGlobalConfig(ctx, &gymrpcv1.GetGlobalConfigRequest{})
	if err != nil {
		return err
	}
	if err := printJSON("config", config); err != nil {
		return err
	}
	statuses, err := head.ListServerStatuses(ctx, &gymrpcv1.ListServerStatusesRequest{})
	if err != nil {
		return err
	}
	if err := printJSON("statuses", statuses); err != nil {
		return err
	}
	// The snapshot first, then each change (no heartbeat within a minute). Cancelling the context ends the stream.
	watch, err := head.WatchServerStatuses(ctx, &gymrpcv1.WatchServerStatusesRequest{
		HeartbeatInterval: durationpb.New(time.Minute),
	})
	if err != nil {
		return err
	}
	for received := 0; received <= changes; received++ {
		event, err := watch.Recv()
		if err != nil {
			return err
		}
		if err := printJSON("watch", event); err != nil {
			return err
		}
	}
	return nil
}

// transportOption is TLS trusting caFile's CA when one is given, plaintext (the head's default) otherwise.
func transportOption(caFile string) (grpc.DialOption, error) {
	if caFile == "" {
		return grpc.WithInsecure(), nil
	}
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return nil, err
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pem) {
		return nil, errors.New("no PEM certificate in " + caFile)
	}
	return grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12})), nil
}

// printJSON prints {"key": <message in the protobuf JSON mapping>} on one line.
func printJSON(key string, message proto.Message) error {
	body, err := protojson.Marshal(message)
	if err != nil {
		return err
	}
	line, err := json.Marshal(map[string]json.RawMessage{key: body}) // also compacts protojson's spacing
	if err != nil {
		return err
	}
	fmt.Println(string(line))
	return nil
}
